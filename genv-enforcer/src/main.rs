fn main() -> std::process::ExitCode {
    genv_enforcer::cli::main()
}
