//! `baton subscriptions rotate-key|get`: webhook signing keys and Durable Streams subscriptions
//! from the command line.

use clap::Subcommand;
use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::client::{encode_segment, error_from, read_json_text, CliError, Client};
use super::exit;
use super::output::{cell, print_json, print_json_exact};

#[derive(Subcommand, Debug)]
pub enum SubscriptionsOp {
    /// Make a new webhook signing key current (admin token) and print its kid. The JWKS lists it
    /// first and keeps the retired key for 7 days.
    RotateKey,
    /// A subscription's JSON (admin token), as the server sends it.
    Get {
        /// Subscription id.
        id: String,
    },
}

pub async fn run(cl: &Client, op: SubscriptionsOp) -> Result<u8, CliError> {
    match op {
        SubscriptionsOp::RotateKey => {
            let v = cl.json_ok(cl.request(Method::POST, "/v1/subscriptions/signing-keys/rotate")).await?;
            if cl.json {
                print_json(&v);
            } else {
                println!("{}", cell(v.get("kid")));
            }
            Ok(exit::OK)
        }
        SubscriptionsOp::Get { id } => {
            let url = format!("/v1/stream/__ds/subscriptions/{}", encode_segment(&id));
            let res = cl.send(cl.request(Method::GET, &url)).await?;
            if res.status() == StatusCode::NOT_FOUND {
                return Err(CliError::not_found(format!("subscription {id:?} not found on {}", cl.base())));
            }
            if !res.status().is_success() {
                return Err(error_from(res).await);
            }
            let (text, _): (String, Value) = read_json_text(res).await?;
            print_json_exact(&text);
            Ok(exit::OK)
        }
    }
}
