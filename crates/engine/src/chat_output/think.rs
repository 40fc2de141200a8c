//! `<think>…</think>` reasoning (Qwen3, DeepSeek, GLM): at the start of the output, or, when
//! the template already opened the tag in the prompt, from the first character.

use super::{OutputOptions, ReasoningFormat, held_back};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// The reasoning (trimmed; empty when there is none or it stays inline) and the rest.
pub(super) fn split<'a>(text: &'a str, partial: bool, opts: &OutputOptions) -> (String, &'a str) {
    if opts.reasoning == ReasoningFormat::None {
        return (String::new(), text);
    }
    let inside = if opts.thinking_open {
        text
    } else {
        let start = text.trim_start();
        match start.strip_prefix(OPEN) {
            Some(inside) => inside,
            // The tag may still be arriving (or only whitespace came so far): nothing is known
            // yet, and streaming the whitespace as content could not be taken back.
            None if partial && OPEN.starts_with(start) => return hold(text),
            None => return (String::new(), text),
        }
    };
    match inside.find(CLOSE) {
        Some(end) => (
            inside[..end].trim().to_string(),
            inside[end + CLOSE.len()..].trim_start(),
        ),
        None => {
            let reasoning = held_back(inside, partial, &[CLOSE]);
            (reasoning.trim().to_string(), &text[text.len()..])
        }
    }
}

fn hold(text: &str) -> (String, &str) {
    (String::new(), &text[text.len()..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(thinking_open: bool) -> OutputOptions {
        OutputOptions {
            thinking_open,
            ..OutputOptions::default()
        }
    }

    #[test]
    fn qwen3_opens_the_tag_itself() {
        let text = "<think>\nThe user greets me.\n</think>\n\nHello!";
        assert_eq!(
            split(text, false, &opts(false)),
            ("The user greets me.".into(), "Hello!")
        );
        // Still thinking: everything so far is reasoning, a split closing tag held back.
        assert_eq!(
            split("<think>\nHmm</thi", true, &opts(false)),
            ("Hmm".into(), "")
        );
        assert_eq!(split("\n<thi", true, &opts(false)), (String::new(), ""));
        assert_eq!(split("\n", true, &opts(false)), (String::new(), ""));
        assert_eq!(split("\n", false, &opts(false)), (String::new(), "\n"));
        assert_eq!(split("Hello", true, &opts(false)), (String::new(), "Hello"));
    }

    #[test]
    fn deepseek_and_glm_prompts_open_it() {
        assert_eq!(
            split("REASONING</think>CONTENT", false, &opts(true)),
            ("REASONING".into(), "CONTENT")
        );
        // Cut short while thinking: all of it is reasoning.
        assert_eq!(
            split("still going", false, &opts(true)),
            ("still going".into(), "")
        );
    }

    #[test]
    fn format_none_keeps_it_inline() {
        let o = OutputOptions {
            reasoning: ReasoningFormat::None,
            ..OutputOptions::default()
        };
        let text = "<think>x</think>y";
        assert_eq!(split(text, false, &o), (String::new(), text));
    }
}
