//! Helpers shared by the command-service test files.
#![allow(dead_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use baton_commands::{
    Command, CommandHandler, CommandResult, CommandState, CommandStore, CommandStoreSettings, HandlerError,
    QueueSettings, RedisCommandStoreOptions, RetryPolicy,
};
use baton_redis::RedisClient;
use baton_testkit::TestBackend;

pub async fn store_for(b: &TestBackend) -> CommandStore {
    store_with(b, CommandStoreSettings::default()).await
}

pub async fn store_with(b: &TestBackend, settings: CommandStoreSettings) -> CommandStore {
    match b.redis_config() {
        None => CommandStore::memory_with(settings).unwrap(),
        Some(cfg) => CommandStore::redis(
            RedisClient::new(cfg).unwrap(),
            RedisCommandStoreOptions { settings, ..Default::default() },
        )
        .await
        .unwrap(),
    }
}

/// A second store on the same backend (Redis: its own connections and subscription, as another
/// process would have); memory: the same store (memory state lives in one store only).
pub async fn other_store(b: &TestBackend, first: &CommandStore) -> CommandStore {
    match b {
        TestBackend::Memory => first.clone(),
        _ => store_for(b).await,
    }
}

pub fn queue_name(tag: &str) -> String {
    format!("{tag}-{}", uuid::Uuid::now_v7())
}

/// Fast test settings: short claim timeout, check interval and backoff.
pub fn fast() -> QueueSettings {
    let defaults = QueueSettings::default();
    QueueSettings {
        claim_timeout: Duration::from_secs(2),
        check_status_interval: Duration::from_millis(100),
        retry: RetryPolicy {
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(100),
            max_attempts: 3,
            ..defaults.retry
        },
        ..defaults
    }
}

type HandlerFuture = Pin<Box<dyn Future<Output = Result<CommandResult, HandlerError>> + Send>>;
type ExecFn = dyn Fn(Command) -> HandlerFuture + Send + Sync;
type CheckFn = dyn Fn(Command, CommandState) -> HandlerFuture + Send + Sync;
type ValidateFn = fn(&baton_commands::RawJson) -> Result<(), String>;

/// A handler made of closures.
pub struct FnHandler {
    exec: Arc<ExecFn>,
    check: Option<Arc<CheckFn>>,
    validate: Option<ValidateFn>,
}

pub fn on_execute<F, Fut>(f: F) -> FnHandler
where
    F: Fn(Command) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<CommandResult, HandlerError>> + Send + 'static,
{
    FnHandler { exec: Arc::new(move |c| Box::pin(f(c))), check: None, validate: None }
}

impl FnHandler {
    pub fn on_check<F, Fut>(mut self, f: F) -> Self
    where
        F: Fn(Command, CommandState) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<CommandResult, HandlerError>> + Send + 'static,
    {
        self.check = Some(Arc::new(move |c, s| Box::pin(f(c, s))));
        self
    }
    pub fn validating(mut self, v: fn(&baton_commands::RawJson) -> Result<(), String>) -> Self {
        self.validate = Some(v);
        self
    }
}

#[async_trait]
impl CommandHandler for FnHandler {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        (self.exec)(command).await
    }
    async fn check_status(&self, command: Command, state: CommandState) -> Result<CommandResult, HandlerError> {
        match &self.check {
            Some(f) => f(command, state).await,
            None => Ok(CommandResult::running()),
        }
    }
    fn validate(&self, params: &baton_commands::RawJson) -> Result<(), String> {
        match self.validate {
            Some(v) => v(params),
            None => Ok(()),
        }
    }
}

#[allow(unused_imports)]
pub use baton_testkit::eventually;
