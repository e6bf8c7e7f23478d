//! Whether a batch's greedy speculative rows draft next step or decode plain. A round pays only
//! where its tokens come cheaper than plain steps', which turns on the device, the batch's width
//! and how well the drafts are accepted, and all three change while a server runs (on the CPU a
//! verify costs its tokens' arithmetic; on a GPU a wide batch of one-token steps costs about
//! what one does). A greedy row emits the same tokens either way (speculation ≡ plain), so the
//! batch can measure both and keep the faster. vLLM turns speculation off above a fixed batch
//! size instead; this measures.
//!
//! The policy alternates measured windows: a window of the current choice, and after some steps
//! of the faster one (64 by default) a window of the other, since what was slower may not be
//! anymore. Each time the other is still slower the wait doubles, up to 16 times, so that a
//! choice that stays slower costs about one window in a thousand steps; when it has become the
//! faster the wait starts over. The first step after a switch is not measured: it pays the draft
//! model's catch-up over the tokens emitted meanwhile. A rate holds only for about the batch
//! width it was measured at (a batch filling up or draining gives more or fewer tokens a step,
//! whichever choice): measured at a width more than a quarter away from the current window's,
//! the other choice is measured afresh before the two are compared. A window that measures the
//! slower choice again ends after its first measured step if that step's rate is under half
//! the other's: where drafting is that much slower (the tiny trained pair drafting every step
//! serves about half of plain on the CPU, and served 0.23x on a GPU while its head_dim-32
//! attention took a call per row), the window's other steps would only repeat the verdict at
//! the same loss.
//!
//! A drafting window's rate counts the tokens a row gets per step over the last
//! [`ACCEPTANCE_HORIZON`] drafting steps, not over the window's own: acceptance follows the text
//! (rows decoding alike answers pass through predictable and unpredictable stretches together),
//! so one window drew 3.6 tokens a row a step and the next 1.1 (the deep pair on the CPU, 8
//! rows), while a step's time moved by about a tenth; windows that short made the choice follow
//! the stretch a window fell in.

use std::time::Duration;

/// Measured steps per window, by default.
const WINDOW: usize = 4;

/// Steps of the faster choice before the other is measured again, by default.
const REMEASURE_EVERY: usize = 64;

/// The wait before measuring again doubles up to this many times its start.
const MOST_BACKOFF: usize = 16;

/// Drafting steps over which a row's tokens per step are averaged (exponentially).
const ACCEPTANCE_HORIZON: f64 = 32.0;

/// A window that measures the slower choice again ends after its first measured step when its
/// rate is below the other's by this factor: the verdict is already in, and each further step
/// costs its loss.
const CLEARLY_SLOWER: f64 = 2.0;

/// What the greedy speculative rows do at a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    Draft,
    Plain,
}

impl Choice {
    fn other(self) -> Choice {
        match self {
            Choice::Draft => Choice::Plain,
            Choice::Plain => Choice::Draft,
        }
    }

    fn slot(self) -> usize {
        self as usize
    }
}

/// The measured choice between drafting and plain steps ([`DraftPolicy::next`]).
#[derive(Clone, Debug)]
pub struct DraftPolicy {
    window: usize,
    remeasure_every: usize,
    /// Steps of the faster choice before the other is measured again, now.
    wait: usize,
    /// Whether the current window measures the slower choice again.
    remeasuring: bool,
    choice: Choice,
    /// Tokens per second each choice gave over its last window, and the window's mean rows a
    /// step, by [`Choice::slot`].
    rates: [Option<(f64, f64)>; 2],
    /// Steps taken since the last switch.
    steps: usize,
    /// The current window's tokens, rows and time.
    tokens: usize,
    rows: usize,
    time: Duration,
    measured: usize,
    /// A row's tokens per step: the mean over the drafting steps measured so far (at most
    /// [`ACCEPTANCE_HORIZON`] of them, older ones fading exponentially), and how many there were.
    drafted_per_row: f64,
    drafting_steps: f64,
}

impl Default for DraftPolicy {
    fn default() -> DraftPolicy {
        DraftPolicy::new(WINDOW, REMEASURE_EVERY)
    }
}

impl DraftPolicy {
    /// Windows of `window` measured steps (at least 1); the slower choice measured again after
    /// more than `remeasure_every` steps of the faster (0: every window alternates).
    pub fn new(window: usize, remeasure_every: usize) -> DraftPolicy {
        DraftPolicy {
            window: window.max(1),
            remeasure_every,
            wait: remeasure_every,
            remeasuring: false,
            choice: Choice::Draft,
            rates: [None, None],
            steps: 0,
            tokens: 0,
            rows: 0,
            time: Duration::ZERO,
            measured: 0,
            drafted_per_row: 0.0,
            drafting_steps: 0.0,
        }
    }

    /// What the next step does.
    pub fn next(&self) -> Choice {
        self.choice
    }

    /// A step of `rows` rows taken with [`DraftPolicy::next`]'s choice emitted `tokens` (every
    /// row's) in `time`.
    pub fn record(&mut self, rows: usize, tokens: usize, time: Duration) {
        self.steps += 1;
        if self.steps == 1 {
            return;
        }
        if self.choice == Choice::Draft {
            self.drafting_steps = (self.drafting_steps + 1.0).min(ACCEPTANCE_HORIZON);
            let per_row = tokens as f64 / rows.max(1) as f64;
            self.drafted_per_row += (per_row - self.drafted_per_row) / self.drafting_steps;
        }
        self.tokens += tokens;
        self.rows += rows;
        self.time += time;
        self.measured += 1;
        let tokens = match self.choice {
            Choice::Draft => self.drafted_per_row * self.rows as f64,
            Choice::Plain => self.tokens as f64,
        };
        let rate = tokens / self.time.as_secs_f64().max(f64::MIN_POSITIVE);
        let width = self.rows as f64 / self.measured as f64;
        let comparable = |&(_, w): &(f64, f64)| (w - width).abs() <= 0.25 * width.max(w);
        let other = self.rates[self.choice.other().slot()].filter(comparable);
        let clearly_slower =
            self.remeasuring && other.is_some_and(|(r, _)| rate * CLEARLY_SLOWER < r);
        if self.measured < self.window && !clearly_slower {
            return;
        }
        let measured = self.measured;
        (self.tokens, self.rows, self.time, self.measured) = (0, 0, Duration::ZERO, 0);
        self.rates[self.choice.slot()] = Some((rate, width));
        let (switch, remeasure) = match other.map(|(r, _)| r) {
            None => (true, false),
            Some(other) if other > rate => {
                if self.remeasuring {
                    let most = self.remeasure_every * MOST_BACKOFF;
                    self.wait = (self.wait * 2).min(most);
                }
                (true, false)
            }
            Some(_) => {
                if self.remeasuring {
                    self.wait = self.remeasure_every;
                }
                let due = self.steps > self.wait;
                (due, due)
            }
        };
        tracing::debug!(
            "draft policy: {:?} window of {measured} steps {rate:.0} tok/s over {width:.1} rows, \
             the other {:?}; {}",
            self.choice,
            other.map(|(r, w)| format!("{r:.0} tok/s over {w:.1} rows")),
            if switch { "switching" } else { "staying" }
        );
        self.remeasuring = remeasure;
        if switch {
            self.choice = self.choice.other();
            self.steps = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps where drafting gives `draft` tokens a step and plain `plain`, each in
    /// one millisecond; returns the choices taken.
    fn run(policy: &mut DraftPolicy, steps: usize, draft: usize, plain: usize) -> Vec<Choice> {
        (0..steps)
            .map(|_| {
                let choice = policy.next();
                let tokens = if choice == Choice::Draft {
                    draft
                } else {
                    plain
                };
                policy.record(8, tokens, Duration::from_millis(1));
                choice
            })
            .collect()
    }

    fn assert_rate(policy: &DraftPolicy, choice: Choice, want: f64) {
        let (rate, _) = policy.rates[choice.slot()].unwrap();
        assert!(
            (rate - want).abs() < 1e-6 * want,
            "{choice:?}: {rate} tokens/s, not {want}"
        );
    }

    /// Asserts that `choices` open with a whole window of drafting, then one of plain (each
    /// window's first step unmeasured); returns the length of one.
    fn assert_first_windows_whole(choices: &[Choice]) -> usize {
        let first = WINDOW + 1;
        assert!(choices[..first].iter().all(|&c| c == Choice::Draft));
        assert!(choices[first..2 * first]
            .iter()
            .all(|&c| c == Choice::Plain));
        first
    }

    #[test]
    fn it_measures_both_then_keeps_the_faster_and_measures_the_other_again() {
        let mut policy = DraftPolicy::default();
        let choices = run(&mut policy, 300, 12, 20);
        // A window of each, then plain, the faster.
        let first = assert_first_windows_whole(&choices);
        assert_rate(&policy, Choice::Draft, 12000.0);
        assert_rate(&policy, Choice::Plain, 20000.0);
        // Drafting again for a window after REMEASURE_EVERY steps of plain, then after twice
        // as many.
        let plain = &choices[first..first + REMEASURE_EVERY];
        assert!(plain.iter().all(|&c| c == Choice::Plain));
        let again = first + REMEASURE_EVERY + 1;
        assert!(choices[again..again + first]
            .iter()
            .all(|&c| c == Choice::Draft));
        let after = &choices[again + first..again + first + 2 * REMEASURE_EVERY];
        assert!(after.iter().all(|&c| c == Choice::Plain));
    }

    #[test]
    fn a_choice_that_stays_slower_is_measured_ever_more_rarely() {
        let mut policy = DraftPolicy::default();
        let steps = 20_000;
        let choices = run(&mut policy, steps, 12, 20);
        let drafting = choices.iter().filter(|&&c| c == Choice::Draft).count();
        // Waits of 64, 128, ..., 1024 steps, then 1024 each: one window in about a thousand.
        let windows = 5 + (steps - 2000) / (REMEASURE_EVERY * MOST_BACKOFF) + 2;
        assert!(
            drafting <= (WINDOW + 1) * windows,
            "{drafting} steps drafted"
        );
        assert!(drafting > (WINDOW + 1) * 10, "{drafting} steps drafted");
    }

    #[test]
    fn a_clearly_slower_choice_is_measured_again_in_one_step() {
        let mut policy = DraftPolicy::default();
        let choices = run(&mut policy, 200, 4, 20);
        // Whole windows while there is nothing to compare with, and while plain is the faster.
        let first = assert_first_windows_whole(&choices);
        // Drafting measured again: its unmeasured first step and one measured step, at a fifth
        // of plain's rate.
        let again = first + REMEASURE_EVERY + 1;
        let window = &choices[again - 1..again + 3];
        use Choice::{Draft, Plain};
        assert_eq!(window, [Plain, Draft, Draft, Plain]);
        assert_rate(&policy, Choice::Draft, 4000.0);
    }

    #[test]
    fn a_choice_that_became_faster_is_taken() {
        let mut policy = DraftPolicy::default();
        run(&mut policy, 100, 8, 20);
        // Drafting now pays: once the windows that measure it have outweighed the acceptance
        // it had before, it is taken for good.
        let choices = run(&mut policy, 2000, 30, 20);
        assert_eq!(choices.last(), Some(&Choice::Draft));
        assert_rate(&policy, Choice::Draft, 30000.0);
        let tail = &choices[choices.len() - REMEASURE_EVERY..];
        assert!(tail.iter().filter(|&&c| c == Choice::Draft).count() > REMEASURE_EVERY / 2);
    }

    /// Steps where drafting's tokens follow a text of 26 steps, 6 of them predictable (30
    /// tokens over 8 rows) and 20 not (12): 16.2 tokens a step on average, against `plain`.
    /// Returns the share of the steps that drafted.
    fn drafted_share(plain: usize) -> f64 {
        let mut policy = DraftPolicy::default();
        let steps = 5000;
        let drafted = (0..steps)
            .filter(|step| {
                let choice = policy.next();
                let tokens = match choice {
                    Choice::Draft if step % 26 < 6 => 30,
                    Choice::Draft => 12,
                    Choice::Plain => plain,
                };
                policy.record(8, tokens, Duration::from_millis(1));
                choice == Choice::Draft
            })
            .count();
        drafted as f64 / steps as f64
    }

    #[test]
    fn drafting_is_judged_by_its_acceptance_over_the_text_not_over_one_window() {
        // A window of 4 steps mostly falls in the unpredictable stretch, where 12 tokens lose
        // to plain's 14; over the text drafting gives 16.2 and wins.
        let share = drafted_share(14);
        assert!(share > 0.8, "drafted {share} of the steps");
        // And where plain gives 18, drafting's good stretches do not win it back.
        let share = drafted_share(18);
        assert!(share < 0.1, "drafted {share} of the steps");
    }

    #[test]
    fn a_rate_of_another_batch_width_is_measured_afresh() {
        let mut policy = DraftPolicy::default();
        // Drafting measured over 4 rows, plain over 16: more tokens a step, but a wider batch.
        for (rows, tokens) in [(4, 8), (16, 16)] {
            for _ in 0..=WINDOW {
                policy.record(rows, tokens, Duration::from_millis(1));
            }
        }
        // Plain is not taken as faster: drafting is measured again at 16 rows first.
        assert_eq!(policy.next(), Choice::Draft);
        for _ in 0..=WINDOW {
            policy.record(16, 40, Duration::from_millis(1));
        }
        assert_eq!(policy.next(), Choice::Draft);
        // A row's tokens per step: 2 over the first window, 2.5 over this one.
        assert_rate(&policy, Choice::Draft, 2.25 * 16.0 * 1000.0);
    }

    #[test]
    fn the_first_step_after_a_switch_is_not_measured() {
        let mut policy = DraftPolicy::default();
        // A catch-up step far slower than the rest must not decide.
        policy.record(8, 1, Duration::from_secs(10));
        for _ in 0..WINDOW {
            policy.record(8, 10, Duration::from_millis(1));
        }
        assert_rate(&policy, Choice::Draft, 10000.0);
        assert_eq!(policy.next(), Choice::Plain);
    }
}
