//! The order genv lists GPU processes in.
//!
//! genv builds its process list as `{pid: ... for pid in set(pids)}`, so the order is
//! CPython's iteration order of a `set` of ints, and that order decides which processes
//! the greedy memory rule terminates. For ints `hash(n) == n`, so the order is
//! deterministic given the insertion order, and this module reproduces it: open
//! addressing over a power-of-two table with 9 linear probes, then perturbed probing,
//! growing to `used * 4` (or `* 2` past 50,000) once 3/5 full (CPython
//! `Objects/setobject.c`, unchanged in this respect from 3.5 to 3.13).

const MIN_SIZE: usize = 8;
const LINEAR_PROBES: usize = 9;
const PERTURB_SHIFT: u32 = 5;

/// `values` deduplicated, in the order `iter(set(values))` yields them.
pub fn python_set_order(values: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut table: Vec<Option<u32>> = vec![None; MIN_SIZE];
    let mut used = 0usize;
    for value in values {
        if insert(&mut table, value) {
            used += 1;
            let mask = table.len() - 1;
            // `fill * 5 >= mask * 3` (no deletions, so fill == used).
            if used * 5 >= mask * 3 {
                let min_used = if used > 50_000 { used * 2 } else { used * 4 };
                let mut size = MIN_SIZE;
                while size <= min_used {
                    size <<= 1;
                }
                let old = std::mem::replace(&mut table, vec![None; size]);
                for value in old.into_iter().flatten() {
                    insert(&mut table, value);
                }
            }
        }
    }
    table.into_iter().flatten().collect()
}

/// Inserts unless present; returns whether it was new.
fn insert(table: &mut [Option<u32>], value: u32) -> bool {
    let mask = table.len() - 1;
    let mut perturb = value as usize;
    let mut i = value as usize & mask;
    loop {
        let probes = if i + LINEAR_PROBES <= mask {
            LINEAR_PROBES
        } else {
            0
        };
        for slot in &mut table[i..=i + probes] {
            match slot {
                None => {
                    *slot = Some(value);
                    return true;
                }
                Some(existing) if *existing == value => return false,
                Some(_) => {}
            }
        }
        perturb >>= PERTURB_SHIFT;
        i = (i * 5 + 1 + perturb) & mask;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compares with the real interpreter on pid-like sets of many sizes.
    #[test]
    fn matches_cpython() {
        let mut seed = 0x9e37_79b9_u64;
        let mut cases = Vec::new();
        for size in [0usize, 1, 2, 5, 6, 7, 20, 100, 1000, 3000] {
            let pids: Vec<u32> = (0..size)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed % 4_194_304) as u32
                })
                .collect();
            cases.push(pids);
        }
        // Collisions mod the table size, and duplicates.
        cases.push(vec![8, 16, 24, 0, 32, 8, 1, 9]);
        cases.push(vec![21375, 21372, 21364, 21372]);
        let input: Vec<String> = cases
            .iter()
            .map(|c| c.iter().map(u32::to_string).collect::<Vec<_>>().join(","))
            .collect();
        let script = "import sys\nfor line in sys.stdin.read().split('\\n'):\n    xs = [int(x) for x in line.split(',') if x]\n    print(','.join(str(x) for x in set(xs)))\n";
        let output = run_python(script, &input.join("\n"));
        for (case, expected) in cases.iter().zip(output.lines()) {
            let ours: Vec<String> = python_set_order(case.iter().copied())
                .iter()
                .map(u32::to_string)
                .collect();
            assert_eq!(ours.join(","), expected, "set({case:?})");
        }
    }

    fn run_python(script: &str, stdin: &str) -> String {
        use std::io::Write;
        let mut child = std::process::Command::new("python3")
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 is needed to check CPython's set order");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    }
}
