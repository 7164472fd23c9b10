//! The `compactor` command line: its shape (`args`), the flags' layering
//! (`layered`), start-up (`serve`), the read-only views (`render`), the
//! commands that change the store (`maintain`), `doctor` and `connect`, and
//! what they all print (`out`).

use std::process::ExitCode;

mod args;
mod audit;
pub mod connect;
pub mod doctor;
mod layered;
mod maintain;
mod out;
mod reach;
mod render;
mod serve;

pub use args::{
    Cli, Command, CompactArgs, ConversationsCommand, DemoArgs, LogFormat, MaintainArgs, PruneArgs,
    ServeArgs, StoreArgs,
};
pub use layered::{layered_config, with_database_url, ConfigArgs};
pub use maintain::parse_age;
pub use out::EXIT_USAGE;
pub use reach::admin_target;
pub use render::utc_time;
pub use serve::shutdown_signal;

use maintain::{compact, prune};
use out::print_out;
use render::conversations;
use serve::{demo, serve};

/// Runs the parsed command line.
pub fn main(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Serve(args) => serve(args),
        Command::Conversations(cmd) => conversations(cmd),
        Command::Compact(args) => compact(args),
        Command::Prune(args) => prune(args),
        Command::Demo(args) => demo(args),
        Command::Doctor(args) => doctor::main(args),
        Command::Connect(args) => connect::main(args),
        Command::Run(args) => connect::run(args),
        Command::Completions { shell } => completions(shell),
    }
}

fn completions(shell: clap_complete::Shell) -> ExitCode {
    use clap::CommandFactory;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "compactor", &mut script);
    print_out(&String::from_utf8_lossy(&script))
}
