//! Work that outgrows one machine: a command's cases split deterministically into `N` shards (`--shard K/N`: case
//! `i` belongs to shard `i mod N + 1`), each shard's results written as JSON (`--json FILE`), and `kvrelay merge`
//! combining the shards' files into the one result the unsharded command gives. A CI matrix or a Slurm array job
//! (`--shard slurm`: `SLURM_ARRAY_TASK_ID` of `SLURM_ARRAY_TASK_MIN..=SLURM_ARRAY_TASK_MAX`) runs one shard per job.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Shard `index` (1-based) of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Shard {
    pub index: u32,
    pub count: u32,
}

impl Shard {
    /// The whole: one shard of one.
    pub const ALL: Shard = Shard { index: 1, count: 1 };

    /// Whether case `case` (counted from 0 in the command's own order) belongs to this shard.
    pub fn takes(self, case: u64) -> bool {
        case % u64::from(self.count) == u64::from(self.index - 1)
    }

    /// This shard's items of `items` (in the command's own order): the ones [`Shard::takes`].
    pub fn pick<T>(self, items: impl IntoIterator<Item = T>) -> impl Iterator<Item = T> {
        items.into_iter().enumerate().filter(move |(index, _)| self.takes(*index as u64)).map(|(_, item)| item)
    }

    /// The shard of a Slurm array task, from the array's variables (`env`: a variable's value): task ids
    /// `SLURM_ARRAY_TASK_MIN ..= SLURM_ARRAY_TASK_MAX` are shards `1 ..= N` (a step other than 1 is refused).
    pub fn from_slurm(env: &dyn Fn(&str) -> Option<String>) -> Result<Shard, String> {
        let number = |name: &str| -> Result<u32, String> {
            let text = env(name).ok_or_else(|| {
                format!(
                    "--shard slurm outside a Slurm array job: {name} is not set (fix: sbatch --array, or --shard K/N)"
                )
            })?;
            text.trim().parse().map_err(|_| format!("{name}={text} is not a task id"))
        };
        let (task, min, max) =
            (number("SLURM_ARRAY_TASK_ID")?, number("SLURM_ARRAY_TASK_MIN")?, number("SLURM_ARRAY_TASK_MAX")?);
        if let Some(step) = env("SLURM_ARRAY_TASK_STEP").filter(|step| step.trim() != "1") {
            return Err(format!("SLURM_ARRAY_TASK_STEP={step}: shards need consecutive task ids (fix: --array=0-N)"));
        }
        if min > task || task > max {
            return Err(format!("SLURM_ARRAY_TASK_ID={task} is outside {min}..={max}"));
        }
        Ok(Shard { index: task - min + 1, count: max - min + 1 })
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl FromStr for Shard {
    type Err = String;

    /// `K/N` with `1 <= K <= N`.
    fn from_str(text: &str) -> Result<Shard, String> {
        let (index, count) = text.split_once('/').ok_or_else(|| format!("--shard {text}: expected K/N, e.g. 2/8"))?;
        let parse =
            |part: &str| part.trim().parse::<u32>().map_err(|_| format!("--shard {text}: {part} is not a number"));
        let shard = Shard { index: parse(index)?, count: parse(count)? };
        if shard.count == 0 || shard.index == 0 || shard.index > shard.count {
            return Err(format!("--shard {text}: K must be 1..=N and N at least 1 (shards are counted from 1)"));
        }
        Ok(shard)
    }
}

/// The shards of one sharded run, as their files say: every shard `1..=N` once, all of one `N`; an error names
/// what is missing or repeated.
pub fn complete(shards: &[Shard]) -> Result<(), String> {
    let Some(count) = shards.first().map(|shard| shard.count) else {
        return Err("no shard files to merge".to_owned());
    };
    if let Some(other) = shards.iter().find(|shard| shard.count != count) {
        return Err(format!("shard {other} does not belong to a run of {count} shards"));
    }
    let mut seen = vec![false; count as usize];
    for shard in shards {
        let slot = &mut seen[shard.index as usize - 1];
        if *slot {
            return Err(format!("shard {shard} is given twice"));
        }
        *slot = true;
    }
    let missing: Vec<String> =
        (1..=count).filter(|index| !seen[*index as usize - 1]).map(|i| format!("{i}/{count}")).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "shard(s) {} missing (fix: run them with --shard and pass their --json files too)",
            missing.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_every_case_exactly_once() {
        for count in 1..=7u32 {
            for case in 0..50u64 {
                let owners = (1..=count).filter(|index| Shard { index: *index, count }.takes(case)).count();
                assert_eq!(owners, 1, "case {case} of {count} shards");
            }
        }
    }

    #[rstest::rstest]
    #[case("0/4", "counted from 1")]
    #[case("5/4", "K must be 1..=N")]
    #[case("1/0", "N at least 1")]
    #[case("2", "expected K/N")]
    #[case("a/4", "a is not a number")]
    fn a_shard_that_does_not_exist_is_refused(#[case] text: &str, #[case] words: &str) {
        let error = text.parse::<Shard>().expect_err("refused");
        assert!(error.contains(words), "{error}");
    }

    #[test]
    fn a_slurm_array_task_is_its_shard() {
        let env = |name: &str| {
            [("SLURM_ARRAY_TASK_ID", "5"), ("SLURM_ARRAY_TASK_MIN", "3"), ("SLURM_ARRAY_TASK_MAX", "10")]
                .iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| (*value).to_owned())
        };
        assert_eq!(Shard::from_slurm(&env), Ok(Shard { index: 3, count: 8 }));
        assert!(Shard::from_slurm(&|_: &str| None).unwrap_err().contains("outside a Slurm array job"));
    }

    #[test]
    fn a_merge_needs_every_shard_once() {
        let shard = |index| Shard { index, count: 3 };
        assert_eq!(complete(&[shard(2), shard(1), shard(3)]), Ok(()));
        assert!(complete(&[shard(1), shard(3)]).unwrap_err().contains("2/3 missing"));
        assert!(complete(&[shard(1), shard(1), shard(2), shard(3)]).unwrap_err().contains("given twice"));
        assert!(complete(&[shard(1), Shard { index: 2, count: 2 }]).unwrap_err().contains("run of 3 shards"));
        assert!(complete(&[]).is_err());
    }
}
