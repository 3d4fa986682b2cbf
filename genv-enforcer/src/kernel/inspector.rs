//! The snapshot's view of processes where kernel programs run: `/proc` for everything,
//! except that a process's environment comes from the identity the kernel recorded at
//! its exec, which the process cannot write over.

use std::io;

use crate::backends::devmap::DeviceMap;
use crate::backends::proc_events::ProcEvents;
use crate::backends::procfs::{EnvironError, ProcStat, StatFile};
use crate::kernel::policy_maps::IdentityReader;
use crate::snapshot::{ProcessInspector, Procfs};

pub struct KernelInspector {
    procfs: Procfs,
    identities: IdentityReader,
}

impl KernelInspector {
    pub fn new(identities: IdentityReader) -> Self {
        Self {
            procfs: Procfs::default(),
            identities,
        }
    }
}

impl ProcessInspector for KernelInspector {
    fn stat(&self, pid: u32) -> io::Result<ProcStat> {
        self.procfs.stat(pid)
    }
    fn stat_cached(&self, pid: u32, handle: &mut Option<StatFile>) -> io::Result<ProcStat> {
        self.procfs.stat_cached(pid, handle)
    }
    fn environment_id(&self, pid: u32) -> Result<Option<String>, EnvironError> {
        self.procfs.environment_id(pid)
    }
    fn kernel_identity(&self, pid: u32) -> Option<u64> {
        self.identities.get(pid)
    }
    fn real_uid(&self, pid: u32) -> io::Result<u32> {
        self.procfs.real_uid(pid)
    }
    fn gpu_node_holders(&self, map: &DeviceMap) -> io::Result<Vec<(u32, Vec<u32>)>> {
        self.procfs.gpu_node_holders(map)
    }
    fn gpu_node_holders_among(&self, map: &DeviceMap, pids: &[u32]) -> Vec<(u32, Vec<u32>)> {
        self.procfs.gpu_node_holders_among(map, pids)
    }
    fn process_events(&self) -> Option<ProcEvents> {
        self.procfs.process_events()
    }
}
