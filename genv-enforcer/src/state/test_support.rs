//! Helpers of the state's tests and the suites that build on them (snapshot, report,
//! intake): genv's own shape of each file, and arbitrary inputs around it. Compiled
//! for tests only.

pub(crate) mod arbitrary;
pub(crate) mod genv_shape;
