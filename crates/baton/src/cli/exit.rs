//! Exit codes of the client subcommands (the `cli` module docs and docs/cli.md).

pub const OK: u8 = 0;
pub const UNSUCCESSFUL: u8 = 1;
pub const USAGE: u8 = 2;
pub const NOT_FOUND: u8 = 3;
pub const REFUSED: u8 = 4;
pub const SERVER: u8 = 5;
pub const TIMEOUT: u8 = 6;
