//! A fault for the cluster tests, in builds with the `dev-hooks` feature only:
//! `CAIRN_DEBUG_LOSE_PASS=N` makes this worker lose its Nth pass to another
//! worker (it is never sent), as a link that died with the message in it would.
//! Release builds have no such code: `lose_this` is always false there.

#[derive(Debug, Default)]
pub(super) struct LosePass {
    #[cfg(feature = "dev-hooks")]
    nth: Option<u64>,
    #[cfg(feature = "dev-hooks")]
    passes: std::cell::Cell<u64>,
}

impl LosePass {
    #[cfg(feature = "dev-hooks")]
    pub(super) fn from_env() -> LosePass {
        LosePass {
            nth: std::env::var("CAIRN_DEBUG_LOSE_PASS")
                .ok()
                .and_then(|v| v.parse().ok()),
            passes: Default::default(),
        }
    }

    #[cfg(not(feature = "dev-hooks"))]
    pub(super) fn from_env() -> LosePass {
        LosePass {}
    }

    /// Counts a pass about to go to another worker; true for the one to lose.
    pub(super) fn lose_this(&self) -> bool {
        #[cfg(feature = "dev-hooks")]
        {
            self.passes.set(self.passes.get() + 1);
            self.nth == Some(self.passes.get())
        }
        #[cfg(not(feature = "dev-hooks"))]
        false
    }
}

#[cfg(all(test, feature = "dev-hooks"))]
mod tests {
    use super::*;

    #[test]
    fn only_the_nth_pass_is_lost() {
        let l = LosePass {
            nth: Some(3),
            ..Default::default()
        };
        let lost: Vec<bool> = (0..5).map(|_| l.lose_this()).collect();
        assert_eq!(lost, [false, false, true, false, false]);
        assert!(!(0..5).any(|_| LosePass::default().lose_this()));
    }
}
