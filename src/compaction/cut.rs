//! Where the history is cut: everything before the cut is compacted,
//! everything from the cut on is sent verbatim.
//!
//! A *safe* cut leaves no call before it whose output comes after it, so a
//! tool batch (an assistant message with parallel calls and its outputs) is
//! never split. Cuts may fall inside the current turn, but only there.

use serde_json::Value;

use super::items::{call_ids, is_system, is_user_message, leading_system, output_ids};

/// `safe[i]` says whether cutting before item `i` is safe (`0..=n`).
pub fn safe_cuts(items: &[Value]) -> Vec<bool> {
    let n = items.len();
    // open[i] > 0: some call before i still waits for an output at or after i.
    let mut delta = vec![0i64; n + 2];
    let mut call_at: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (i, item) in items.iter().enumerate() {
        for id in call_ids(item) {
            call_at.insert(id, i);
        }
        for id in output_ids(item) {
            if let Some(&k) = call_at.get(id) {
                if k < i {
                    // Cuts at k+1..=i would separate call k from output i.
                    delta[k + 1] += 1;
                    delta[i + 1] -= 1;
                }
            }
        }
    }
    let mut open = 0i64;
    (0..=n)
        .map(|i| {
            open += delta[i];
            open == 0
        })
        .collect()
}

/// Chooses the cut: the largest verbatim tail whose tokens fit `tail_budget`,
/// at a safe position after the leading system items and before the last
/// item (the tail is never empty, the compacted part never empty). When even
/// the smallest safe tail is over budget, the smallest safe tail is taken.
/// `None` when no safe cut exists.
pub fn choose_cut(items: &[Value], tokens: &[u64], tail_budget: u64) -> Option<usize> {
    let n = items.len();
    let safe = safe_cuts(items);
    // Nothing at or before a provider compaction item is cut.
    let lead = leading_system(items).max(super::boundary::safe_floor(items, &safe));
    if n < lead + 2 {
        return None;
    }
    let mut suffix = vec![0u64; n + 1];
    for i in (0..n).rev() {
        suffix[i] = suffix[i + 1] + tokens[i];
    }
    let candidates = (lead + 1..n).filter(|&i| safe[i]);
    let mut last = None;
    for i in candidates {
        if suffix[i] <= tail_budget {
            return Some(i);
        }
        last = Some(i);
    }
    last
}

/// The user messages of `part` to keep verbatim: newest first while they fit
/// `budget` tokens, returned in their original order as indices into `part`.
/// The newest one is kept even over budget when `keep_newest` is set (the
/// latest user message must always reach the model verbatim).
pub fn recent_user_messages(
    part: &[Value],
    tokens: &[u64],
    budget: u64,
    keep_newest: bool,
) -> Vec<usize> {
    let mut kept = Vec::new();
    let mut used = 0u64;
    for i in (0..part.len()).rev().filter(|&i| is_user_message(&part[i])) {
        let t = tokens[i];
        if used + t <= budget || (keep_newest && kept.is_empty()) {
            used += t;
            kept.push(i);
        } else {
            break;
        }
    }
    kept.reverse();
    kept
}

/// The items of `part` a summary keeps verbatim after it, as indices into
/// `part` in their original order: every system message (a harness's
/// instructions in the middle of the conversation — Claude Code's
/// environment, tools and skills, a reminder — go as they came, whatever
/// the budget) and the recent user messages ([`recent_user_messages`]).
pub fn kept_verbatim(part: &[Value], tokens: &[u64], budget: u64, keep_newest: bool) -> Vec<usize> {
    let users = recent_user_messages(part, tokens, budget, keep_newest);
    let mut kept: Vec<usize> = (0..part.len()).filter(|&i| is_system(&part[i])).collect();
    kept.extend(users);
    kept.sort_unstable();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hist() -> Vec<Value> {
        vec![
            json!({"role": "system", "content": "s"}),
            json!({"role": "user", "content": "u1"}),
            json!({"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]}),
            json!({"role": "tool", "tool_call_id": "a", "content": "A"}),
            json!({"role": "tool", "tool_call_id": "b", "content": "B"}),
            json!({"role": "assistant", "content": "done"}),
            json!({"role": "user", "content": "u2"}),
        ]
    }

    #[test]
    fn parallel_batches_are_atomic() {
        let safe = safe_cuts(&hist());
        assert_eq!(safe, vec![true, true, true, false, false, true, true, true]);
    }

    #[test]
    fn cut_prefers_the_largest_tail_that_fits() {
        let h = hist();
        let tokens = vec![1, 10, 5, 50, 50, 5, 10];
        assert_eq!(choose_cut(&h, &tokens, 200), Some(2));
        assert_eq!(choose_cut(&h, &tokens, 20), Some(5));
        // Nothing fits: the smallest safe tail.
        assert_eq!(choose_cut(&h, &tokens, 1), Some(6));
        assert_eq!(choose_cut(&h[..2], &tokens[..2], 100), None);
    }

    #[test]
    fn system_messages_are_kept_whatever_the_budget_in_order() {
        let part = vec![
            json!({"role": "user", "content": "task"}),
            json!({"role": "system", "content": "environment"}),
            json!({"role": "assistant", "content": "x"}),
            json!({"role": "user", "content": "new"}),
            json!({"role": "developer", "content": "reminder"}),
        ];
        let tokens = [5, 900, 1, 5, 900];
        assert_eq!(kept_verbatim(&part, &tokens, 5, true), vec![1, 3, 4]);
        assert_eq!(kept_verbatim(&part, &tokens, 0, false), vec![1, 4]);
        assert_eq!(kept_verbatim(&part, &tokens, 10, true), vec![0, 1, 3, 4]);
    }

    #[test]
    fn recent_users_newest_first_within_budget() {
        let part = vec![
            json!({"role": "user", "content": "old"}),
            json!({"role": "assistant", "content": "x"}),
            json!({"role": "user", "content": "mid"}),
            json!({"role": "user", "content": "new"}),
        ];
        assert_eq!(
            recent_user_messages(&part, &[5, 1, 5, 5], 10, true),
            vec![2, 3]
        );
        assert_eq!(
            recent_user_messages(&part, &[5, 1, 5, 50], 10, true),
            vec![3]
        );
        assert_eq!(
            recent_user_messages(&part, &[5, 1, 5, 50], 10, false),
            Vec::<usize>::new()
        );
    }
}
