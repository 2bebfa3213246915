//! Work spread over threads, answers in the order given: the oracle's ranks (`harness::check_ranks`) and a wave's
//! requests (`engine::direct::Lowered::per_request`).

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

/// `work` of each task on at most `workers` threads, the caller's among them, each taking the next task not yet
/// taken (a long task does not hold up the ones queued behind it); the answers in the order of `tasks`. The threads
/// start one another as a binary tree: on a lent GPU machine a thread's start cost about 30 µs of the starter's
/// time, so 16 threads started by one took 0.3 to 0.5 ms, several times a rank's share of the oracle's walk. A
/// worker's panic is resumed here, once every worker stopped.
pub fn spread<I: Sync, T: Send>(tasks: &[I], workers: usize, work: impl Fn(&I) -> T + Sync) -> Vec<T> {
    let workers = workers.min(tasks.len()).max(1);
    if workers == 1 {
        return tasks.iter().map(&work).collect();
    }
    let pool = Pool {
        tasks,
        work: &work,
        workers,
        next: AtomicUsize::new(0),
        done: Mutex::new(Vec::with_capacity(tasks.len())),
        panic: Mutex::new(None),
    };
    std::thread::scope(|scope| pool.worker(scope, 0));
    if let Some(panic) = pool.panic.into_inner().unwrap_or_else(PoisonError::into_inner) {
        std::panic::resume_unwind(panic);
    }
    let mut done = pool.done.into_inner().unwrap_or_else(PoisonError::into_inner);
    done.sort_unstable_by_key(|(index, _)| *index);
    done.into_iter().map(|(_, answer)| answer).collect()
}

/// What the workers of one [`spread`] share.
struct Pool<'a, I, T, W> {
    tasks: &'a [I],
    work: &'a W,
    workers: usize,
    next: AtomicUsize,
    done: Mutex<Vec<(usize, T)>>,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl<I: Sync, T: Send, W: Fn(&I) -> T + Sync> Pool<'_, I, T, W> {
    /// Worker `me`: starts workers `2 me + 1` and `2 me + 2` (those that exist), then takes tasks until none is left.
    fn worker<'scope>(&'scope self, scope: &'scope std::thread::Scope<'scope, '_>, me: usize) {
        for child in [2 * me + 1, 2 * me + 2].into_iter().filter(|child| *child < self.workers) {
            scope.spawn(move || self.worker(scope, child));
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut mine = Vec::new();
            loop {
                let index = self.next.fetch_add(1, Ordering::Relaxed);
                let Some(task) = self.tasks.get(index) else { return mine };
                mine.push((index, (self.work)(task)));
            }
        }));
        match outcome {
            Ok(mine) => self.done.lock().unwrap_or_else(PoisonError::into_inner).extend(mine),
            Err(panic) => {
                // The other workers stop at the next task: nothing is left to take.
                self.next.store(self.tasks.len(), Ordering::Relaxed);
                self.panic.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(panic);
            }
        }
    }
}

/// The machine's cores (1 where it cannot say).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

#[cfg(test)]
mod tests {
    use super::spread;

    #[test]
    fn answers_come_in_task_order_whatever_the_workers() {
        let tasks: Vec<u64> = (0..100).collect();
        for workers in [1, 2, 3, 7, 16, 200] {
            let answers = spread(&tasks, workers, |task| task * task);
            assert_eq!(answers, tasks.iter().map(|task| task * task).collect::<Vec<_>>(), "{workers} workers");
        }
    }

    #[test]
    fn a_worker_panic_is_resumed_with_its_message() {
        let tasks: Vec<u32> = (0..32).collect();
        let caught = std::panic::catch_unwind(|| {
            spread(&tasks, 8, |task| {
                assert!(*task != 17, "task seventeen failed");
                *task
            })
        });
        let payload = caught.expect_err("the panic reaches the caller");
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|text| (*text).to_owned()))
            .unwrap_or_default();
        assert!(message.contains("task seventeen failed"), "{message}");
    }
}
