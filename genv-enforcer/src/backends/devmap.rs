//! Which device node is which GPU: `(major, minor)` → NVML index.
//!
//! The major comes from `/proc/devices` (the driver registers `nvidia-frontend` or
//! `nvidia`, 195 on every driver so far); minors from NVML's minor number of each device,
//! since the minor is not the index in general (NVML orders by PCI bus id, the driver
//! numbers in probe order). `--gpu-node MAJOR:MINOR=INDEX` adds or replaces entries.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use genv_ebpf_common::kernel_dev;

use super::nvml::GpuInfo;

/// The major NVIDIA's GPU nodes have had on every driver.
pub const NVIDIA_MAJOR: u32 = 195;

/// `--gpu-node MAJOR:MINOR=INDEX`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeOverride {
    pub major: u32,
    pub minor: u32,
    pub index: u32,
}

impl FromStr for NodeOverride {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let invalid =
            || format!("not a GPU node: {text:?} (expected MAJOR:MINOR=INDEX, e.g. 195:0=0)");
        let (node, index) = text.split_once('=').ok_or_else(invalid)?;
        let (major, minor) = node.split_once(':').ok_or_else(invalid)?;
        let number = |s: &str| s.trim().parse::<u32>().map_err(|_| invalid());
        let (major, minor, index) = (number(major)?, number(minor)?, number(index)?);
        if major >= 1 << 12 || minor >= 1 << 20 {
            return Err(format!(
                "not a GPU node: {text:?} (major must be below 4096 and minor below 1048576)"
            ));
        }
        Ok(Self {
            major,
            minor,
            index,
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceMap {
    nodes: BTreeMap<(u32, u32), u32>,
    /// Neither NVML nor the driver said which minor is which GPU: `major:N` is taken
    /// to be GPU `N` (below the control nodes' minors), said once by the caller.
    guessed_major: Option<u32>,
}

/// The first of the NVIDIA major's control minors (`nvidia-modeset` 254, `nvidiactl`
/// 255): minors below it are GPUs.
const FIRST_CONTROL_MINOR: u32 = 254;

impl DeviceMap {
    /// From what the system says: NVML's devices (or, without NVML, the driver's minors
    /// in PCI order), the major in `/proc/devices`, then the overrides.
    pub fn build(
        devices: &[GpuInfo],
        driver_minors: Option<Vec<u32>>,
        proc_devices: Option<&str>,
        overrides: &[NodeOverride],
    ) -> Self {
        let major = proc_devices.and_then(nvidia_major).unwrap_or(NVIDIA_MAJOR);
        let mut nodes = BTreeMap::new();
        let mut guessed_major = None;
        if devices.iter().any(|d| d.minor.is_some()) {
            for device in devices {
                if let Some(minor) = device.minor {
                    nodes.insert((major, minor), device.index);
                }
            }
        } else if let Some(minors) = driver_minors {
            nodes.extend(
                minors
                    .into_iter()
                    .zip(0..)
                    .map(|(minor, index)| ((major, minor), index)),
            );
        } else {
            guessed_major = Some(major);
        }
        for o in overrides {
            nodes.insert((o.major, o.minor), o.index);
        }
        Self {
            nodes,
            guessed_major,
        }
    }

    /// The GPU index of node `major:minor`, if it is a GPU's.
    pub fn index_of(&self, major: u32, minor: u32) -> Option<u32> {
        if let Some(index) = self.nodes.get(&(major, minor)) {
            return Some(*index);
        }
        (self.guessed_major == Some(major) && minor < FIRST_CONTROL_MINOR).then_some(minor)
    }

    /// Whether GPU nodes are guessed as `/dev/nvidiaN` = GPU N.
    pub fn is_guessed(&self) -> bool {
        self.guessed_major.is_some()
    }

    /// `(kernel dev_t, index)` pairs, for the programs' map.
    pub fn kernel_entries(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.nodes
            .iter()
            .map(|(&(major, minor), &index)| (kernel_dev(major, minor), index))
    }
}

impl fmt::Display for DeviceMap {
    /// `195:0=GPU0, 1:7=GPU0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.nodes.is_empty() {
            return f.write_str("no GPU nodes");
        }
        let entries: Vec<String> = self
            .nodes
            .iter()
            .map(|((major, minor), index)| format!("{major}:{minor}=GPU{index}"))
            .collect();
        f.write_str(&entries.join(", "))
    }
}

/// The character major registered as `nvidia-frontend` or `nvidia` in `/proc/devices`.
pub fn nvidia_major(proc_devices: &str) -> Option<u32> {
    let characters = proc_devices
        .split("Block devices:")
        .next()
        .unwrap_or(proc_devices);
    characters.lines().find_map(|line| {
        let (number, name) = line.trim().split_once(' ')?;
        matches!(name.trim(), "nvidia-frontend" | "nvidia").then(|| number.parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, minor: Option<u32>) -> GpuInfo {
        GpuInfo {
            index,
            uuid: format!("GPU-{index}"),
            minor,
            total_memory: 0,
        }
    }

    #[test]
    fn minors_come_from_nvml_not_from_the_index() {
        let map = DeviceMap::build(&[gpu(0, Some(2)), gpu(1, Some(0))], None, None, &[]);
        assert_eq!(map.index_of(195, 2), Some(0));
        assert_eq!(map.index_of(195, 0), Some(1));
        assert_eq!(map.index_of(195, 1), None);
    }

    #[test]
    fn the_major_comes_from_proc_devices() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n510 nvidia-uvm\n\nBlock devices:\n195 nvidia\n";
        assert_eq!(nvidia_major(text), Some(195));
        let text = "Character devices:\n  1 mem\n234 nvidia\n236 nvidia-uvm\n";
        let map = DeviceMap::build(&[gpu(0, Some(0))], None, Some(text), &[]);
        assert_eq!(map.index_of(234, 0), Some(0));
        assert_eq!(nvidia_major("Character devices:\n  1 mem\n"), None);
    }

    #[test]
    fn without_nvml_the_drivers_pci_order_gives_the_index() {
        let map = DeviceMap::build(&[], Some(vec![1, 0]), None, &[]);
        assert_eq!(map.index_of(195, 1), Some(0));
        assert_eq!(map.index_of(195, 0), Some(1));
    }

    #[test]
    fn without_nvml_or_driver_minors_are_guessed_and_overrides_still_count() {
        let overrides = ["1:7=0".parse().unwrap()];
        let map = DeviceMap::build(&[], None, None, &overrides);
        assert!(map.is_guessed());
        assert_eq!(map.index_of(195, 3), Some(3));
        assert_eq!(map.index_of(195, 255), None, "nvidiactl is no GPU");
        assert_eq!(map.index_of(1, 7), Some(0));
        assert_eq!(map.index_of(1, 8), None);
        assert_eq!(
            map.kernel_entries().count(),
            1,
            "only what is known goes to the kernel"
        );
    }

    #[test]
    fn overrides_add_and_replace() {
        let overrides = ["1:7=0".parse().unwrap(), "195:0=3".parse().unwrap()];
        let map = DeviceMap::build(&[gpu(0, Some(0))], None, None, &overrides);
        assert_eq!(map.index_of(1, 7), Some(0));
        assert_eq!(map.index_of(195, 0), Some(3));
        assert_eq!(map.to_string(), "1:7=GPU0, 195:0=GPU3");
    }

    #[test]
    fn bad_overrides_say_what_is_expected() {
        for bad in ["195:0", "195=0", "a:0=0", "195:0=x", "5000:0=0"] {
            let err = bad.parse::<NodeOverride>().unwrap_err();
            assert!(err.contains(bad), "{err}");
        }
    }
}
