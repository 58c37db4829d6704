//! `echo`: succeeds with its params.

use async_trait::async_trait;

use crate::{Command, CommandHandler, CommandResult, HandlerError};

/// The `echo` built-in handler: any params (any JSON value, `null` included); `execute` succeeds
/// at once with the params as the result.
#[derive(Clone, Copy, Debug, Default)]
pub struct EchoHandler;

#[async_trait]
impl CommandHandler for EchoHandler {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        Ok(CommandResult::succeeded(command.params))
    }
}
