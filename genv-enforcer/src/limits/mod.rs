//! The bounds a root daemon keeps against its users, who can knock as often as they
//! like: a token bucket ([`bucket`]), for lines, requests, examinations and snapshots;
//! the connections one peer may hold open to a socket the daemon serves
//! ([`connections`]).

pub mod bucket;
pub mod connections;

pub use bucket::{Rate, TokenBucket};
pub use connections::Connections;
