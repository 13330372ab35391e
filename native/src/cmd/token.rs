//! `cairn token list|new|revoke`: a running `cairn serve`'s worker join
//! tokens, through its admin API (`/api/tokens`).

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    /// The coordinator's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    api: String,
    /// Its admin key.
    #[arg(long, env = "CAIRN_API_KEY")]
    api_key: Option<String>,
    #[command(subcommand)]
    action: Action,
}

#[derive(clap::Subcommand)]
enum Action {
    /// The join tokens issued that have not expired (ids, never the tokens).
    List,
    /// Issue a worker token; prints it once.
    New {
        /// Seconds it is valid (default: the server's --join-ttl).
        #[arg(long)]
        ttl: Option<u64>,
    },
    /// Revoke a token by id: refused from now on, its workers dropped.
    Revoke {
        /// The token's id, as `list` shows it. Ids are URL-safe base64, so one may start with
        /// `-`; it is taken as the id, not as an option.
        #[arg(allow_hyphen_values = true)]
        id: String,
    },
}

pub fn run(a: Args) -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(call(a))
}

async fn call(a: Args) -> Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let base = a.api.trim_end_matches('/');
    let request = match &a.action {
        Action::List => client.get(format!("{base}/api/tokens")),
        Action::New { ttl } => client
            .post(format!("{base}/api/tokens"))
            .json(&serde_json::json!({ "ttl_s": ttl })),
        Action::Revoke { id } => client.delete(format!("{base}/api/tokens/{id}")),
    };
    let request = match &a.api_key {
        Some(k) => request.bearer_auth(k),
        None => request,
    };
    let response = request
        .send()
        .await
        .with_context(|| format!("reaching {base}"))?;
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        let why = body["error"]["message"]
            .as_str()
            .unwrap_or("no reason given");
        bail!("{status}: {why}");
    }
    match a.action {
        Action::List => {
            let tokens = body["tokens"].as_array().cloned().unwrap_or_default();
            if tokens.is_empty() {
                println!("no join tokens");
            }
            let now = cairn_signal::token::unix_now();
            for t in tokens {
                let left = t["expires_at"].as_u64().unwrap_or(0).saturating_sub(now);
                let state = if t["revoked"].as_bool() == Some(true) {
                    "revoked"
                } else {
                    "valid"
                };
                println!(
                    "{}  {}  {state}, expires in {left} s",
                    t["id"].as_str().unwrap_or("?"),
                    t["role"].as_str().unwrap_or("?"),
                );
            }
        }
        Action::New { .. } => {
            println!("id:      {}", body["id"].as_str().unwrap_or("?"));
            println!("expires: {} (unix time)", body["expires_at"]);
            println!("token:   {}", body["token"].as_str().unwrap_or("?"));
        }
        Action::Revoke { id } => {
            println!(
                "revoked {id}; dropped {} live session(s)",
                body["dropped"].as_u64().unwrap_or(0)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: super::Args,
    }

    #[test]
    fn an_id_starting_with_a_hyphen_is_revoked_not_taken_for_an_option() {
        let cli = Cli::try_parse_from(["cairn", "revoke", "--q3medeH0pisWy0"]).unwrap();
        match cli.args.action {
            super::Action::Revoke { id } => assert_eq!(id, "--q3medeH0pisWy0"),
            _ => panic!("not a revoke"),
        }
    }
}
