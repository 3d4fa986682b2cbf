//! What can go wrong loading the programs or using their maps, in one place that both
//! the loader and the map handles draw on.

use std::error::Error;
use std::path::PathBuf;

use aya::maps::MapError;
use aya::programs::ProgramError;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Tracefs(#[from] super::tracefs::TracefsError),
    #[error("reading struct offsets: {0}")]
    Offsets(#[from] super::offsets::OffsetsError),
    #[error("loading the kernel object: {0}")]
    Object(String),
    #[error("program {program}: {message}")]
    Program {
        program: &'static str,
        message: String,
    },
    #[error("map {map}: {message}")]
    Map { map: &'static str, message: String },
    #[error("no open tier could be loaded: {0}")]
    NoTier(String),
    #[error("pinning {path}: {message}")]
    Pin { path: PathBuf, message: String },
    /// A libcuda the probes were not attached to, and why (its name first).
    #[error("{0}")]
    Library(String),
    /// The libcuda probes (`--memory-at-alloc`), asked for, could not be loaded.
    #[error("the libcuda probes: {0}")]
    MemoryAtAlloc(String),
}

/// An error with its causes, as one line: aya's outer errors rarely say the errno.
pub(super) fn chain(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    // aya appends the verifier's log, empty when the kernel refused before verifying.
    let trimmed = text.trim_end();
    let trimmed = trimmed.strip_suffix("Verifier output:").unwrap_or(trimmed);
    trimmed.trim_end().trim_end_matches('.').to_owned()
}

pub(super) fn program_error(program: &'static str) -> impl Fn(ProgramError) -> LoadError {
    move |e| LoadError::Program {
        program,
        message: chain(&e),
    }
}

pub(super) fn map_error(map: &'static str) -> impl Fn(MapError) -> LoadError {
    move |e| LoadError::Map {
        map,
        message: chain(&e),
    }
}

/// Takes a map out of the loaded object, as the typed handle `T`.
pub(super) fn take_map<T>(ebpf: &mut aya::Ebpf, map: &'static str) -> Result<T, LoadError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let raw = ebpf.take_map(map).ok_or(LoadError::Map {
        map,
        message: "not in the object".into(),
    })?;
    T::try_from(raw).map_err(map_error(map))
}
