//! The attribute files the probe keeps open between probes, process-wide, within a budget
//! that follows the descriptor limit and shrinks when the descriptor table fills up.
//!
//! The files live here, not in the attributes that read them, so that running out of
//! descriptors can close some of them at once ([`shed`]): an attribute only names its entry,
//! and one whose file was shed is read by opening it again.

use std::fs::File;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The fewest descriptors never given to kept-open attributes: the metrics server's default
/// 64 connections, the 64 the agent reserves for the API client, the runtime and verbs, and
/// the probe's own listings and per-read opens.
const RESERVE: u64 = 128;
/// The most attribute files kept open under any limit.
pub(crate) const CEILING: usize = 65_536;
/// The budget now ([`budget`]); `usize::MAX` until it is first asked for.
static BUDGET: AtomicUsize = AtomicUsize::new(usize::MAX);
static POOL: Mutex<Pool> = Mutex::new(Pool {
    entries: Vec::new(),
    free: Vec::new(),
    generation: 0,
    open: 0,
});

struct Pool {
    /// A kept file and the generation it was kept under, so that an entry reused after a
    /// shed is never read by the attribute that had it before.
    entries: Vec<Option<(u64, Arc<File>)>>,
    free: Vec<usize>,
    generation: u64,
    open: usize,
}

/// One entry of the pool, owned by one attribute.
#[derive(Debug)]
pub(crate) struct Kept {
    index: usize,
    generation: u64,
}

fn pool() -> MutexGuard<'static, Pool> {
    // A panic elsewhere cannot leave a pool half-updated in a way that matters: at worst a
    // count is off by one until that entry is released.
    POOL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The budget for a soft `RLIMIT_NOFILE` (`None`: unlimited): half of what the limit leaves
/// after [`RESERVE`], at most [`CEILING`], and 0 under a limit so low that every attribute is
/// opened, read and closed on each read. A node's GID tables alone can hold thousands of
/// files (rxe: 1024 entries x 3 attributes per port), so a fixed budget either runs a small
/// limit out of descriptors (EMFILE fails every other read, verbs included) or reopens files
/// a large limit could keep. A node agent runs with its soft limit raised to the hard one
/// (1,048,576 in most container runtimes), so every attribute of a large node stays open; a
/// bench-12x2 probe is then ~1,900 `pread`s and no `open`.
pub(crate) fn budget_for(soft: Option<u64>) -> usize {
    soft.map_or(CEILING, |s| {
        usize::try_from(s.saturating_sub(RESERVE) / 2).unwrap_or(CEILING)
    })
    .min(CEILING)
}

/// [`budget_for`] the process's soft limit, read when first asked (the agent raises its limit
/// before its first probe), lowered by each [`shed`].
pub(crate) fn budget() -> usize {
    let now = BUDGET.load(Ordering::Relaxed);
    if now != usize::MAX {
        return now;
    }
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    let _ = BUDGET.compare_exchange(
        usize::MAX,
        budget_for(soft),
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    BUDGET.load(Ordering::Relaxed)
}

/// Keep `file` if fewer than `budget` are kept; `Err(file)` hands it back otherwise.
pub(crate) fn keep(file: File, budget: usize) -> Result<Kept, File> {
    let mut pool = pool();
    if pool.open >= budget {
        return Err(file);
    }
    pool.generation += 1;
    let generation = pool.generation;
    let entry = Some((generation, Arc::new(file)));
    let index = match pool.free.pop() {
        Some(i) => {
            pool.entries[i] = entry;
            i
        }
        None => {
            pool.entries.push(entry);
            pool.entries.len() - 1
        }
    };
    pool.open += 1;
    Ok(Kept { index, generation })
}

impl Kept {
    /// The file, unless it was shed (the caller opens the path again). The pool is not held
    /// while the caller reads.
    pub(crate) fn file(&self) -> Option<Arc<File>> {
        match pool().entries.get(self.index) {
            Some(Some((g, f))) if *g == self.generation => Some(Arc::clone(f)),
            _ => None,
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let mut pool = pool();
        let Some(slot) = pool.entries.get_mut(self.index) else {
            return;
        };
        if matches!(slot, Some((g, _)) if *g == self.generation) {
            *slot = None;
            pool.open -= 1;
            pool.free.push(self.index);
        }
    }
}

/// The descriptor table is full (the limit was lowered, or other files took what the budget
/// counted on): close half of the kept files now and keep no more than the rest, so the
/// open that failed can be tried again and later attributes are read by reopening.
/// `false` when nothing was kept, so there was nothing to free.
pub(crate) fn shed() -> bool {
    budget();
    let mut pool = pool();
    let keep = pool.open / 2;
    let mut closed = 0;
    let Pool {
        entries,
        free,
        open,
        ..
    } = &mut *pool;
    for (i, slot) in entries.iter_mut().enumerate().rev() {
        if *open <= keep {
            break;
        }
        if slot.take().is_some() {
            *open -= 1;
            free.push(i);
            closed += 1;
        }
    }
    BUDGET.fetch_min(keep, Ordering::Relaxed);
    closed > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The budget follows the descriptor limit: room for the server and the probe's own
    /// opens under a small limit (none kept at all under a tiny one), every attribute of a
    /// large node under a container's raised limit.
    #[test]
    fn the_budget_follows_the_descriptor_limit() {
        assert_eq!(budget_for(Some(256)), 64);
        assert_eq!(budget_for(Some(1024)), 448);
        assert_eq!(budget_for(Some(100)), 0);
        assert_eq!(budget_for(Some(0)), 0);
        assert_eq!(budget_for(Some(20_000)), (20_000 - 128) / 2);
        assert_eq!(budget_for(Some(1_048_576)), CEILING);
        assert_eq!(budget_for(None), CEILING);
    }

    /// An entry reused after it was released is not read by its old owner.
    #[test]
    fn a_released_entry_is_never_read_by_its_old_owner() {
        let dir = tempfile::tempdir().unwrap();
        let open = |name: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, name).unwrap();
            File::open(path).unwrap()
        };
        let first = keep(open("a"), usize::MAX).unwrap();
        let stale = Kept {
            index: first.index,
            generation: first.generation,
        };
        drop(first);
        let second = keep(open("b"), usize::MAX).unwrap();
        assert!(stale.file().is_none(), "a released entry is still read");
        drop(stale);
        let text = std::io::read_to_string(&*second.file().unwrap()).unwrap();
        assert_eq!(
            text, "b",
            "releasing a stale entry closed its new owner's file"
        );
    }
}
