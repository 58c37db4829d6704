//! CPU time of processes, in ns: the sum over their threads of `/proc/<pid>/task/*/schedstat`
//! (time on CPU; exited threads are not counted, so measure long-lived processes).

fn of_pid(pid: &str) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// CPU time of these processes (all their threads).
pub fn of(pids: &[u32]) -> u64 {
    pids.iter().map(|p| of_pid(&p.to_string())).sum()
}

/// CPU time of this process.
pub fn own() -> u64 {
    of_pid("self")
}
