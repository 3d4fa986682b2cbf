//! Builds the kernel programs (`genv-ebpf`) for the BPF target with the nightly
//! toolchain and `bpf-linker` (`cargo xtask build-ebpf` installs both), so that the
//! daemon embeds the object it loads.

fn main() -> anyhow::Result<()> {
    // aya-build watches the program crate; the shared types change the object too.
    println!("cargo:rerun-if-changed=../genv-ebpf-common");
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "genv-ebpf",
            root_dir: "../genv-ebpf",
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
