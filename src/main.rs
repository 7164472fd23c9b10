//! The `compactor` binary: parse the command line and hand over to the library.

use clap::Parser;

/// A proxy allocates and frees many small JSON nodes per request from
/// several threads; mimalloc keeps that cheap where glibc's malloc spends a
/// quarter of the request path in its own bookkeeping.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    compactor::cli::main(compactor::cli::Cli::parse())
}
