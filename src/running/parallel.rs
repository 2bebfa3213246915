//! Work spread over threads, answers in the order given: the oracle's ranks (`harness::check_ranks`) and a wave's
//! requests (`engine::direct::Lowered::per_request`).

/// `work` of each task on at most `workers` threads, each thread taking the next task not yet taken (a long task
/// does not hold up the ones queued behind it); the answers in the order of `tasks`. A worker's panic is resumed
/// here.
pub fn spread<I: Sync, T: Send>(tasks: &[I], workers: usize, work: impl Fn(&I) -> T + Sync) -> Vec<T> {
    let workers = workers.min(tasks.len()).max(1);
    if workers == 1 {
        return tasks.iter().map(&work).collect();
    }
    let mut answers: Vec<Option<T>> = std::iter::repeat_with(|| None).take(tasks.len()).collect();
    let (work, next) = (&work, &std::sync::atomic::AtomicUsize::new(0));
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(task) = tasks.get(index) else { return done };
                        done.push((index, work(task)));
                    }
                })
            })
            .collect();
        for handle in handles {
            match handle.join() {
                Ok(done) => done.into_iter().for_each(|(index, answer)| answers[index] = Some(answer)),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    answers.into_iter().map(|answer| answer.expect("every task done")).collect()
}

/// The machine's cores (1 where it cannot say).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}
