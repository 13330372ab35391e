//! A fault for the spot-check tests, in builds with the `dev-hooks` feature
//! only: `CAIRN_DEBUG_CORRUPT_TOKENS=1` makes this worker report a wrong
//! token for every step it samples, as a broken or lying device would.
//! Release builds have no such code: `token` always returns its input there.

#[derive(Debug, Default)]
pub(super) struct CorruptTokens {
    #[cfg(feature = "dev-hooks")]
    on: bool,
}

impl CorruptTokens {
    #[cfg(feature = "dev-hooks")]
    pub(super) fn from_env() -> CorruptTokens {
        CorruptTokens {
            on: std::env::var("CAIRN_DEBUG_CORRUPT_TOKENS").is_ok_and(|v| v == "1"),
        }
    }

    #[cfg(not(feature = "dev-hooks"))]
    pub(super) fn from_env() -> CorruptTokens {
        CorruptTokens {}
    }

    /// The token to report for a sampled `id`: another one, far from it
    /// (and inside any vocabulary of 32,768 or more), when the fault is on.
    pub(super) fn token(&self, id: u32) -> u32 {
        #[cfg(feature = "dev-hooks")]
        if self.on {
            return (id + 12_345) % 32_768;
        }
        id
    }

    /// `m` with its token corrupted, when it reports one.
    pub(super) fn message(
        &self,
        m: cairn_engine::protocol::Message,
    ) -> cairn_engine::protocol::Message {
        match m {
            cairn_engine::protocol::Message::Token {
                request,
                seq,
                step,
                id,
                passed_on,
            } => cairn_engine::protocol::Message::Token {
                request,
                seq,
                step,
                id: self.token(id),
                passed_on,
            },
            other => other,
        }
    }
}

#[cfg(all(test, feature = "dev-hooks"))]
mod tests {
    use super::*;

    #[test]
    fn only_a_worker_told_to_corrupts_its_tokens() {
        let on = CorruptTokens { on: true };
        assert_ne!(on.token(5), 5);
        assert!(on.token(32_767) < 32_768);
        assert_eq!(CorruptTokens::default().token(5), 5);
    }
}
