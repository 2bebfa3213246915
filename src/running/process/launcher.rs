//! A rank started by the launchers clusters already run: `torchrun` (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`), Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`) and Slurm's `srun`
//! (`SLURM_PROCID`, `SLURM_NTASKS`). `kvrelay serve <scenario>` with no `--role`/`--rank` reads its place from them:
//! global ranks `0 .. prefill` are the prefill ranks in stage-major order, the rest the decode ranks; global rank 0
//! also runs the hub (unless `--no-hub`). The hub's address is `--bootstrap`, else `KVRELAY_HUB`, else
//! `MASTER_ADDR:MASTER_PORT`.
//!
//! Reading the environment is the caller's (an edge); this module only decides, from a lookup it is handed.

use super::Role;

/// Where a launcher put this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// `torchrun`, `Open MPI` or `Slurm`: who said so.
    pub launcher: &'static str,
    pub role: Role,
    /// The rank on its side, in stage-major order (as `--rank`).
    pub rank: u32,
    /// The process's global rank (0 runs the hub).
    pub global: u32,
    /// `HOST:PORT` of the hub.
    pub bootstrap: String,
}

/// The launchers' variables, in the order they are tried: (launcher, rank variable, world-size variable).
const LAUNCHERS: [(&str, &str, &str); 3] = [
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS"),
];

/// This process's place from the launcher environment `env` (a variable's value, or `None`), for a scenario of
/// `prefill` prefill and `decode` decode ranks; `bootstrap` is `--bootstrap` when given. An error names the
/// variable and the fix.
pub fn place(
    env: &dyn Fn(&str) -> Option<String>,
    prefill: u32,
    decode: u32,
    bootstrap: Option<&str>,
) -> Result<Placed, String> {
    let found = LAUNCHERS.iter().find(|(_, rank, _)| env(rank).is_some_and(|value| !value.trim().is_empty()));
    let Some((launcher, rank_var, world_var)) = found else {
        return Err("no --role and --rank, and no launcher environment (RANK and WORLD_SIZE from torchrun, \
                    OMPI_COMM_WORLD_RANK from mpirun, SLURM_PROCID from srun) (fix: pass --role and --rank, or start \
                    the ranks with torchrun, mpirun or srun)"
            .to_owned());
    };
    let number = |var: &str| -> Result<u32, String> {
        let text = env(var).ok_or_else(|| format!("{launcher} set {rank_var} but not {var} (fix: set {var})"))?;
        text.trim().parse::<u32>().map_err(|_| format!("{var}={text} ({launcher}) is not a rank count or index"))
    };
    let (global, world) = (number(rank_var)?, number(world_var)?);
    let ranks = prefill + decode;
    if world != ranks {
        return Err(format!(
            "{world_var}={world} ({launcher}), but the scenario has {prefill} prefill and {decode} decode ranks (fix: \
             start {ranks} processes, e.g. mpirun -np {ranks})"
        ));
    }
    if global >= world {
        return Err(format!("{rank_var}={global} ({launcher}) is not below {world_var}={world}"));
    }
    let (role, rank) = if global < prefill { (Role::Prefill, global) } else { (Role::Decode, global - prefill) };
    let bootstrap = match bootstrap {
        Some(address) => address.to_owned(),
        None => hub_address(env)?,
    };
    Ok(Placed { launcher, role, rank, global, bootstrap })
}

/// `KVRELAY_HUB`, else `MASTER_ADDR:MASTER_PORT`.
fn hub_address(env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    if let Some(address) = env("KVRELAY_HUB").filter(|value| !value.trim().is_empty()) {
        return Ok(address.trim().to_owned());
    }
    match (env("MASTER_ADDR"), env("MASTER_PORT")) {
        (Some(host), Some(port)) if !host.trim().is_empty() => {
            let port = port.trim();
            port.parse::<u16>().map_err(|_| format!("MASTER_PORT={port} is not a port"))?;
            Ok(format!("{}:{port}", host.trim()))
        }
        _ => Err("no hub address: pass --bootstrap HOST:PORT, or set KVRELAY_HUB=HOST:PORT or MASTER_ADDR and \
                  MASTER_PORT (torchrun sets both) (fix: --bootstrap with the address of global rank 0's host)"
            .to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| pairs.iter().find(|(key, _)| *key == name).map(|(_, value)| (*value).to_owned())
    }

    #[rstest::rstest]
    #[case::torchrun_prefill(&[("RANK", "3"), ("WORLD_SIZE", "16"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")], "torchrun", Role::Prefill, 3, "node0:29500")]
    #[case::torchrun_decode(&[("RANK", "8"), ("WORLD_SIZE", "16"), ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")], "torchrun", Role::Decode, 0, "node0:29500")]
    #[case::mpirun(&[("OMPI_COMM_WORLD_RANK", "15"), ("OMPI_COMM_WORLD_SIZE", "16"), ("KVRELAY_HUB", "10.0.0.1:7000")], "Open MPI", Role::Decode, 7, "10.0.0.1:7000")]
    #[case::srun(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "16"), ("KVRELAY_HUB", "head:7000")], "Slurm", Role::Prefill, 0, "head:7000")]
    #[case::hub_variable_before_master(&[("RANK", "1"), ("WORLD_SIZE", "16"), ("KVRELAY_HUB", "a:1"), ("MASTER_ADDR", "b"), ("MASTER_PORT", "2")], "torchrun", Role::Prefill, 1, "a:1")]
    fn a_launcher_places_the_rank(
        #[case] pairs: &'static [(&'static str, &'static str)],
        #[case] launcher: &str,
        #[case] role: Role,
        #[case] rank: u32,
        #[case] bootstrap: &str,
    ) {
        let placed = place(&env(pairs), 8, 8, None).expect("placed");
        assert_eq!(
            (placed.launcher, placed.role, placed.rank, placed.bootstrap.as_str()),
            (launcher, role, rank, bootstrap)
        );
    }

    #[test]
    fn bootstrap_given_wins_over_the_environment() {
        let placed = place(&env(&[("RANK", "0"), ("WORLD_SIZE", "2")]), 1, 1, Some("h:9")).expect("placed");
        assert_eq!(placed.bootstrap, "h:9");
    }

    #[rstest::rstest]
    #[case::no_launcher(&[], "fix: pass --role and --rank")]
    #[case::wrong_world(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("KVRELAY_HUB", "h:1")], "WORLD_SIZE=4 (torchrun), but the scenario has 8 prefill and 8 decode ranks")]
    #[case::rank_past_world(&[("OMPI_COMM_WORLD_RANK", "16"), ("OMPI_COMM_WORLD_SIZE", "16"), ("KVRELAY_HUB", "h:1")], "OMPI_COMM_WORLD_RANK=16 (Open MPI) is not below")]
    #[case::no_world(&[("SLURM_PROCID", "1")], "Slurm set SLURM_PROCID but not SLURM_NTASKS")]
    #[case::not_a_number(&[("RANK", "x"), ("WORLD_SIZE", "16")], "RANK=x (torchrun) is not a rank")]
    #[case::no_hub(&[("RANK", "0"), ("WORLD_SIZE", "16")], "no hub address")]
    #[case::bad_port(&[("RANK", "0"), ("WORLD_SIZE", "16"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "http")], "MASTER_PORT=http is not a port")]
    fn a_launcher_environment_that_does_not_fit_is_a_clear_error(
        #[case] pairs: &'static [(&'static str, &'static str)],
        #[case] words: &str,
    ) {
        let error = place(&env(pairs), 8, 8, None).expect_err("refused");
        assert!(error.contains(words), "{error}");
    }
}
