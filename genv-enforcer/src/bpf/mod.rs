//! The kernel side's userspace half. So far: the struct offsets the open hook needs, read
//! from the running kernel's BTF so that no kernel's layout is compiled in. The programs,
//! their loader and the event intake join with the event-driven mode.

pub mod btf;
