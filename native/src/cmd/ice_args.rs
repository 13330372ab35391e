//! Flags that give `cairn serve` and `cairn worker` their STUN and TURN
//! servers (`LinkConfig::ice_servers`, docs/architecture.md "Peer links").

use cairn_native::link::{IceServer, IceTransportPolicy, LinkConfig};

#[derive(clap::Args, Clone, Debug, Default)]
pub struct IceArgs {
    /// STUN server for server-reflexive link candidates (stun:HOST[:PORT]); repeatable.
    #[arg(long = "stun", value_name = "URL")]
    stun: Vec<String>,
    /// TURN server to relay links through (turn:HOST[:PORT][?transport=udp]); repeatable.
    #[arg(long = "turn", value_name = "URL", requires_all = ["turn_username", "turn_credential"])]
    turn: Vec<String>,
    /// Username on the TURN servers.
    #[arg(long, env = "CAIRN_TURN_USERNAME")]
    turn_username: Option<String>,
    /// Credential (password) on the TURN servers.
    #[arg(long, env = "CAIRN_TURN_CREDENTIAL", hide_env_values = true)]
    turn_credential: Option<String>,
    /// Send every link through the TURN servers (iceTransportPolicy "relay").
    #[arg(long, requires = "turn")]
    relay_only: bool,
}

impl IceArgs {
    /// Adds the servers and the policy to `config`.
    pub fn apply(&self, config: &mut LinkConfig) {
        if !self.stun.is_empty() {
            config.ice_servers.push(IceServer {
                urls: self.stun.clone(),
                ..IceServer::default()
            });
        }
        if !self.turn.is_empty() {
            config.ice_servers.push(IceServer {
                urls: self.turn.clone(),
                username: self.turn_username.clone(),
                credential: self.turn_credential.clone(),
            });
        }
        if self.relay_only {
            config.ice_transport_policy = IceTransportPolicy::Relay;
        }
    }
}
