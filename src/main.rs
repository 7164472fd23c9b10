//! The `compactor` binary: parse the command line and hand over to the library.

use clap::Parser;

fn main() -> std::process::ExitCode {
    compactor::cli::main(compactor::cli::Cli::parse())
}
