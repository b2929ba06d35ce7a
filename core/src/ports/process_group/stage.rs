//! A hierarchical collective's stage failures as the port's errors: the report a rank sends
//! when a stage of its own failed, and the error its receivers fail with. The decisions about
//! reports (bounds, who may blame whom) are [`crate::collective::stage_failure`]'s; this is
//! only their translation from and to [`ProcessGroupError`], kept here so that `collective`
//! does not depend on the port.

use crate::collective::stage_failure::{StageCause, StageReport};

use super::{DeathCause, ProcessGroupError};

/// The report a rank sends when a stage of its hierarchical collective failed with `error`
/// (the stage's own group's error: a timeout names that group's ranks, `members` gives their
/// world ranks; a dead rank is named by its world rank already, and reported only when it is
/// one of `members`), or `None` when the failure is not one this rank saw itself on a rank it
/// waited for.
pub fn stage_report(error: &ProcessGroupError, members: &[usize]) -> Option<StageReport> {
    match error {
        ProcessGroupError::Timeout {
            waiting_on,
            timeout,
            ..
        } => {
            let mut ranks: Vec<usize> = waiting_on
                .iter()
                .map(|r| members.get(*r).copied())
                .collect::<Option<_>>()?;
            ranks.sort_unstable();
            ranks.dedup();
            (!ranks.is_empty()).then_some(StageReport {
                ranks,
                cause: StageCause::TimedOut { waited: *timeout },
            })
        }
        // A death seen on the links may be any rank's: reported only for one of the stage's
        // (a rank blames only those it shares a stage with).
        ProcessGroupError::PeerDied {
            rank,
            reported_by: None,
            ..
        } if members.contains(rank) => Some(StageReport {
            ranks: vec![*rank],
            cause: StageCause::Died,
        }),
        _ => None,
    }
}

impl StageReport {
    /// The error a rank fails with when world rank `reporter` sent this report.
    pub fn error(&self, reporter: usize) -> ProcessGroupError {
        match self.cause {
            StageCause::Died => ProcessGroupError::PeerDied {
                rank: self.ranks[0],
                reported_by: Some(reporter),
                cause: DeathCause::InStage,
            },
            StageCause::TimedOut { waited } => ProcessGroupError::StageTimedOut {
                waiting_on: self.ranks.clone(),
                reported_by: reporter,
                waited,
            },
        }
    }
}

#[cfg(test)]
#[path = "stage_sim.rs"]
mod sim;
