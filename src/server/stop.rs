//! Stop sequences on the decoded text, held back across token (and speculative burst)
//! boundaries: text that could still be the start of a stop sequence is not released until the
//! next token shows whether it is. So a stop split over several tokens is cut exactly, nothing
//! of it ever reaches a client, and because tokens reach the matcher one at a time in the same
//! order whether they were drafted or not, speculative and plain runs stop at the same token.
//!
//! mlx_lm.server 0.32.2 matches stop words on token ids (server.py:1118,
//! `stop_matcher.advance(gen.token)`), which misses a stop that another tokenization of the same
//! text produces; matching on text is what OpenAI documents.

/// Holds back the text that might begin a stop sequence.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What pushing text released.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed {
    /// Text that can no longer be part of a stop sequence (possibly empty).
    Text(String),
    /// A stop sequence matched: the text before it; nothing more is to be released.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops,
            held: String::new(),
        }
    }

    /// Adds decoded text; releases what cannot begin a stop sequence, or the text before the
    /// earliest stop sequence.
    pub fn push(&mut self, text: &str) -> Pushed {
        self.held.push_str(text);
        let earliest = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = earliest {
            let before = self.held[..at].to_string();
            self.held.clear();
            return Pushed::Stopped(before);
        }
        let keep = self.held_suffix();
        let release = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Pushed::Text(release)
    }

    /// The generation ended without a stop sequence: everything held is text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The length in bytes of the longest suffix of the held text that is a proper prefix of
    /// some stop sequence.
    fn held_suffix(&self) -> usize {
        self.held
            .char_indices()
            .map(|(i, _)| &self.held[i..])
            .find(|suffix| self.stops.iter().any(|s| s.starts_with(suffix)))
            .map_or(0, str::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                Pushed::Text(t) => out.push_str(&t),
                Pushed::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn a_stop_split_over_pieces_is_cut_and_never_released() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abc E"), Pushed::Text("abc ".into()));
        assert_eq!(m.push("N"), Pushed::Text(String::new()));
        assert_eq!(m.push("Dx"), Pushed::Stopped(String::new()));
    }

    #[test]
    fn a_false_start_is_released_when_it_cannot_match() {
        assert_eq!(run(&["END"], &["E", "N", "x"]), ("ENx".into(), false));
        assert_eq!(run(&["END"], &["EN"]), ("EN".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".into(), true));
        assert_eq!(run(&["\n\n", "."], &["one. two"]), ("one".into(), true));
    }

    #[test]
    fn multibyte_text_is_held_on_char_boundaries() {
        assert_eq!(run(&["éé"], &["aé", "b"]), ("aéb".into(), false));
        assert_eq!(run(&["éé"], &["aé", "é"]), ("a".into(), true));
    }
}
