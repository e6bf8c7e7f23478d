//! The tokenizer against what mlx-lm produced: every golden trace's prompt tokens are rebuilt from
//! its text, chat templates behave like transformers' Jinja sandbox, and streamed text follows
//! mlx-lm's detokenizers. Expected strings marked "transformers" were rendered by the oracle venv
//! (mlx-lm 0.32.2 + transformers 5.24) from the same templates.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};
use verity::tokenizer::{StreamingDetokenizer, Tokenizer, TokenizerError, UserTurn};

mod support;

use support::root;

fn json_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("readable folder entry").path();
        if path.is_dir() {
            json_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "json") {
            out.push(path);
        }
    }
}

struct Trace {
    id: String,
    model: PathBuf,
    prompt_text: String,
    prompt_chat: bool,
    /// A multi-turn chat's messages (mlx-vlm traces, oracles/record_vlm.py); a one-turn chat is
    /// `prompt_text` as the user's message.
    prompt_messages: Option<Vec<Value>>,
    /// The chat template's output the oracle tokenized (chat prompts only).
    prompt_rendered: Option<String>,
    prompt_tokens: Vec<u32>,
    /// Generated tokens as mlx-lm fed them to its detokenizer (an eos ends generation unadded).
    output_tokens: Vec<u32>,
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("a list of token ids")
        .iter()
        .map(|v| u32::try_from(v.as_u64().expect("token id")).expect("u32 token id"))
        .collect()
}

/// Every golden trace; fails if there are none, since then nothing would be checked.
fn traces() -> Vec<Trace> {
    let mut files = Vec::new();
    json_files(&root().join("golden/traces"), &mut files);
    files.sort();
    assert!(!files.is_empty(), "no golden traces under golden/traces");
    files
        .iter()
        .map(|path| {
            let t: Value = serde_json::from_slice(&fs::read(path).expect("readable trace"))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let eos = t.get("eos_token_ids").map(ids).unwrap_or_default();
            let output_tokens = t["steps"]
                .as_array()
                .expect("steps")
                .iter()
                .map(|s| u32::try_from(s["token"].as_u64().expect("step token")).expect("u32"))
                .filter(|id| !eos.contains(id))
                .collect();
            Trace {
                id: t["id"].as_str().expect("trace id").to_string(),
                model: root().join(t["model"].as_str().expect("model folder")),
                prompt_text: t["prompt"]["text"]
                    .as_str()
                    .expect("prompt text")
                    .to_string(),
                prompt_chat: t["prompt"]["chat"].as_bool().expect("prompt chat flag"),
                prompt_messages: t["prompt"]
                    .get("messages")
                    .map(|m| m.as_array().expect("prompt messages are a list").clone()),
                prompt_rendered: t["prompt"]["rendered"].as_str().map(str::to_string),
                // A trace continuing from a prompt cache holds only the rest of its prompt.
                prompt_tokens: t
                    .get("prompt_cache")
                    .filter(|c| !c.is_null())
                    .map(|c| ids(&c["tokens"]))
                    .unwrap_or_default()
                    .into_iter()
                    .chain(ids(&t["prompt"]["tokens"]))
                    .collect(),
                output_tokens,
            }
        })
        .collect()
}

struct Tokenizers(HashMap<PathBuf, Tokenizer>);

impl Tokenizers {
    fn get(&mut self, dir: &Path) -> &Tokenizer {
        self.0.entry(dir.to_path_buf()).or_insert_with(|| {
            Tokenizer::from_dir(dir).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
        })
    }
}

fn user(content: Value) -> Vec<Value> {
    vec![json!({"role": "user", "content": content})]
}

/// A model folder in the temp dir, removed when dropped.
struct TempModel(PathBuf);

impl TempModel {
    fn empty(name: &str) -> TempModel {
        let dir = std::env::temp_dir().join(format!("verity-tok-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("temp folder");
        TempModel(dir)
    }

    /// The golden fixture tokenizer (byte-level BPE), with `template` as chat_template.jinja.
    fn with_template(name: &str, template: &str) -> TempModel {
        let model = TempModel::empty(name);
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            fs::copy(
                root().join("golden/tokenizer").join(file),
                model.0.join(file),
            )
            .expect("copy fixture");
        }
        model.write("chat_template.jinja", template);
        model
    }

    fn write(&self, file: &str, contents: &str) {
        fs::write(self.0.join(file), contents).expect("write temp file");
    }

    fn load(&self) -> Tokenizer {
        Tokenizer::from_dir(&self.0).unwrap_or_else(|e| panic!("loading {}: {e}", self.0.display()))
    }
}

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn golden_prompts_reproduce_exactly() {
    let mut tokenizers = Tokenizers(HashMap::new());
    let mut mismatches = Vec::new();
    let all = traces();
    for trace in &all {
        let tok = tokenizers.get(&trace.model);
        // What oracles/record.py (mlx_lm.generate's main) did.
        let tokens = if trace.prompt_chat {
            let messages = match &trace.prompt_messages {
                Some(messages) => messages.clone(),
                None => user(json!(trace.prompt_text)),
            };
            let rendered = tok
                .apply_chat_template(&messages, true, &Map::new())
                .unwrap_or_else(|e| panic!("{}: {e}", trace.id));
            if Some(&rendered) != trace.prompt_rendered.as_ref() {
                mismatches.push(format!(
                    "{}: rendered {rendered:?}, recorded {:?}",
                    trace.id, trace.prompt_rendered
                ));
                continue;
            }
            tok.encode(&rendered, false)
        } else {
            tok.encode(&trace.prompt_text, true)
        }
        .unwrap_or_else(|e| panic!("{}: {e}", trace.id));
        if tokens != trace.prompt_tokens {
            let at = tokens
                .iter()
                .zip(&trace.prompt_tokens)
                .take_while(|(a, b)| a == b)
                .count();
            mismatches.push(format!(
                "{}: {} tokens vs {} recorded, first difference at {at}",
                trace.id,
                tokens.len(),
                trace.prompt_tokens.len()
            ));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} traces differ:\n{}",
        mismatches.len(),
        all.len(),
        mismatches.join("\n")
    );
}

#[test]
fn golden_models_render_parts_like_strings() {
    let mut folders: Vec<PathBuf> = fs::read_dir(root().join("golden/models"))
        .expect("golden/models")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("tokenizer.json").is_file())
        .collect();
    folders.sort();
    assert!(!folders.is_empty(), "no model folders under golden/models");
    let text = "Sort [(1, 'b'), (2, 'a')] by the second element — ok?";
    let mut failures = Vec::new();
    for dir in &folders {
        let tok = Tokenizer::from_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        assert!(
            tok.has_chat_template(),
            "{} has no chat template",
            dir.display()
        );
        for add_generation_prompt in [false, true] {
            let render = |content| {
                tok.apply_chat_template(&user(content), add_generation_prompt, &Map::new())
            };
            let plain = render(json!(text)).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            let parts = render(json!([{"type": "text", "text": text}]))
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            if plain != parts || !plain.contains(text) {
                failures.push(format!("{}: {plain:?} vs {parts:?}", dir.display()));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn template_errors_are_errors() {
    let model = TempModel::with_template("syntax", "{% for m in messages %}{{ m.content }");
    let err = model
        .load()
        .apply_chat_template(&user(json!("hi")), true, &Map::new())
        .expect_err("a syntax error must not render");
    assert!(
        matches!(err, TokenizerError::TemplateSyntax { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("chat_template.jinja"), "{err}");

    let model = TempModel::with_template(
        "raise",
        "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation must start with a system message') }}{% endif %}",
    );
    let err = model
        .load()
        .apply_chat_template(&user(json!("hi")), true, &Map::new())
        .expect_err("raise_exception must fail the render");
    match &err {
        TokenizerError::TemplateRaised { message, .. } => {
            assert_eq!(message, "Conversation must start with a system message")
        }
        other => panic!("expected TemplateRaised, got {other:?}"),
    }

    let model = TempModel::with_template("undefined", "{{ messages[0].nothing.deeper }}");
    let err = model
        .load()
        .apply_chat_template(&user(json!("hi")), true, &Map::new())
        .expect_err("attribute of undefined fails in Jinja2 too");
    assert!(
        matches!(err, TokenizerError::TemplateRender { .. }),
        "{err:?}"
    );

    let tok = TempModel::with_template("chat", "{{ messages[0].content }}").load();
    for bad in [vec![], vec![json!("not a message")]] {
        let err = tok
            .apply_chat_template(&bad, true, &Map::new())
            .expect_err("invalid chat");
        assert!(matches!(err, TokenizerError::InvalidChat(_)), "{err:?}");
    }
}

#[test]
fn template_renders_values_like_transformers() {
    let render = |name: &str, template: &str| {
        let tok = TempModel::with_template(name, template).load();
        let messages =
            vec![json!({"role": "user", "content": "hi", "x": null, "reasoning_content": "r"})];
        tok.apply_chat_template(&messages, true, &Map::new())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    // Expected outputs were rendered by transformers from the same templates.
    assert_eq!(
        render(
            "tojson",
            "{{ {'b': 1, 'a': '<é>&\"', 'c': [1.5, true, none, 1e20, 2.0]} | tojson }}|{{ [] | tojson(indent=2) }}|{{ {'x': {'y': [1, {}]}, 'z': 'q'} | tojson(indent=2) }}|{{ 'é\n' | tojson(ensure_ascii=true) }}|{{ {'b':1,'a':2} | tojson(sort_keys=true, separators=[',', ':']) }}"
        ),
        "{\"b\": 1, \"a\": \"<é>&\\\"\", \"c\": [1.5, true, null, 1e+20, 2.0]}|[]|{\n  \"x\": {\n    \"y\": [\n      1,\n      {}\n    ]\n  },\n  \"z\": \"q\"\n}|\"\\u00e9\\n\"|{\"a\":2,\"b\":1}"
    );
    assert_eq!(
        render(
            "pyfmt",
            "{{ true }} {{ false }} {{ none }} {{ [1, 'a', none, 1.5, \"it's\"] }} {{ {'k': false} }} {{ 0.0001 }} {{ 1e-05 }} {{ 10 / 4 }} {{ undefined_var }}|"
        ),
        "True False None [1, 'a', None, 1.5, \"it's\"] {'k': False} 0.0001 1e-05 2.5 |"
    );
    // None-valued keys are dropped, reasoning is aliased, tools/documents are none and mlx-lm
    // passes enable_thinking (false: the fixture vocabulary has no <think>).
    assert_eq!(
        render(
            "vars",
            "{{ messages | length }}|{{ tools }}|{{ documents }}|{{ enable_thinking }}|{{ eos_token }}|{{ pad_token }}|{{ bos_token }}|{{ add_generation_prompt }}|{{ messages[0].keys() | list }}|{{ messages[0].thinking }}"
        ),
        "1|None|None|False|<|im_end|>|<|endoftext|>||True|['thinking', 'role', 'content', 'reasoning_content']|r"
    );
    assert_eq!(
        render(
            "gen",
            "{% for m in messages %}A{%- generation -%}  {{ m.content }}  {%- endgeneration %}B\n{% endfor %}"
        ),
        "AhiB\n"
    );
    assert_eq!(
        render(
            "methods",
            "{{ '  x y '.strip() }}|{{ 'a,b'.split(',') }}|{{ 'abc'.startswith('a') }}|{{ messages[::-1][0].role }}|{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ 'Hi'.upper() }}|{{ messages[0].get('content') }}"
        ),
        "x y|['a', 'b']|True|user|1|HI|hi"
    );
    assert_eq!(
        render(
            "trim",
            "{% if true %}\n   yes\n  {% endif %}\n{%- for m in messages %}\n{{ m.role }}\n{% endfor %}\n"
        ),
        "   yes\nuser\n"
    );
}

#[test]
fn template_extra_variables_and_dates() {
    let tok = TempModel::with_template(
        "extra",
        "{{ enable_thinking }}|{{ tools | tojson }}|{{ strftime_now('%Y-%m-%d %b') }}",
    )
    .load();
    let mut extra = Map::new();
    extra.insert("enable_thinking".into(), json!(true));
    extra.insert("tools".into(), json!([{"name": "f"}]));
    let out = tok
        .apply_chat_template(&user(json!("hi")), false, &extra)
        .expect("renders");
    let (head, date) = out.rsplit_once('|').expect("three fields");
    assert_eq!(head, "True|[{\"name\": \"f\"}]");
    let (ymd, month) = date.split_once(' ').expect("date and month");
    let fields: Vec<&str> = ymd.split('-').collect();
    assert_eq!(fields.len(), 3, "{date}");
    assert!(fields[0].parse::<u32>().expect("year") >= 2024, "{date}");
    let m: usize = fields[1].parse().expect("month");
    let names = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    assert_eq!(names.get(m.wrapping_sub(1)), Some(&month), "{date}");
}

#[test]
fn template_file_wins_over_inline_config() {
    // transformers 5.24 reads chat_template.jinja over tokenizer_config.json's chat_template.
    let model = TempModel::with_template("priority", "FILE {{ messages[0].content }}");
    let mut config: Value =
        serde_json::from_slice(&fs::read(model.0.join("tokenizer_config.json")).expect("config"))
            .expect("config json");
    config["chat_template"] = json!("CONFIG {{ messages[0].content }}");
    model.write("tokenizer_config.json", &config.to_string());
    let render = |tok: &Tokenizer| tok.apply_chat_template(&user(json!("x")), false, &Map::new());
    assert_eq!(render(&model.load()).expect("renders"), "FILE x");
    fs::remove_file(model.0.join("chat_template.jinja")).expect("remove template file");
    assert_eq!(render(&model.load()).expect("renders"), "CONFIG x");

    config
        .as_object_mut()
        .expect("object")
        .remove("chat_template");
    model.write("tokenizer_config.json", &config.to_string());
    let tok = model.load();
    assert!(!tok.has_chat_template());
    let err = render(&tok).expect_err("no template");
    assert!(matches!(err, TokenizerError::NoChatTemplate(_)), "{err:?}");
}

#[test]
fn named_templates_pick_tool_use_when_tools_are_given() {
    // transformers' get_chat_template over a config's list of named templates.
    let model = TempModel::with_template("named", "unused");
    fs::remove_file(model.0.join("chat_template.jinja")).expect("remove template file");
    let mut config: Value =
        serde_json::from_slice(&fs::read(model.0.join("tokenizer_config.json")).expect("config"))
            .expect("config json");
    config["chat_template"] = json!([
        {"name": "default", "template": "D{{ tools }}"},
        {"name": "tool_use", "template": "T{{ tools | tojson }}"},
    ]);
    model.write("tokenizer_config.json", &config.to_string());
    let tok = model.load();
    let mut extra = Map::new();
    let render =
        |extra: &Map<String, Value>| tok.apply_chat_template(&user(json!("x")), false, extra);
    assert_eq!(render(&extra).expect("renders"), "DNone");
    extra.insert("tools".into(), json!([{"name": "f"}]));
    assert_eq!(render(&extra).expect("renders"), "T[{\"name\": \"f\"}]");
}

#[test]
fn tokenizers_and_detokenizers_can_cross_threads() {
    // The engine keeps MLX on one thread and serves requests from others.
    fn shareable<T: Send + Sync>() {}
    fn movable<T: Send>() {}
    shareable::<Tokenizer>();
    movable::<StreamingDetokenizer>();
    movable::<TokenizerError>();
}

#[test]
fn special_tokens_and_vocab() {
    let tok = Tokenizer::from_dir(&root().join("golden/tokenizer")).expect("fixture loads");
    let eos = tok.eos_token_id().expect("fixture has an eos token");
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(eos));
    assert_eq!(tok.decode(&[eos]).expect("decodes"), "<|im_end|>");
    assert_eq!(tok.bos_token(), None);
    assert!(tok.vocab_size() > usize::try_from(eos).expect("small id"));
    // Special tokens in text are matched whole, as HF does.
    let ids = tok.encode("a<|im_end|>b", false).expect("encodes");
    assert!(ids.contains(&eos), "{ids:?}");
    let text = "def f(x):\n\treturn x  # Grüße 東京 😀\n";
    assert_eq!(
        tok.decode(&tok.encode(text, true).expect("encodes"))
            .expect("decodes"),
        text
    );
}

/// Streams `ids` one at a time, returning every segment (the last one from finalize).
fn stream(det: &mut StreamingDetokenizer, ids: &[u32]) -> Vec<String> {
    let mut segments: Vec<String> = ids
        .iter()
        .map(|&id| {
            det.add_token(id);
            det.take_segment()
        })
        .collect();
    segments.push(det.finalize());
    segments
}

#[test]
fn streaming_matches_decode_on_golden_outputs() {
    let mut tokenizers = Tokenizers(HashMap::new());
    let mut failures = Vec::new();
    let all = traces();
    for trace in &all {
        let tok = tokenizers.get(&trace.model);
        let mut det = tok.detokenizer();
        let segments = stream(&mut det, &trace.output_tokens);
        let joined = segments.concat();
        assert_eq!(
            joined,
            det.text(),
            "{}: segments must add up to text()",
            trace.id
        );
        let decoded = tok.decode(&trace.output_tokens).expect("decodes");
        // mlx-lm drops one leading space of the output. Otherwise streaming equals a one-shot
        // lossy decode even where that has U+FFFD: text is only released after a complete
        // character, and UTF-8 decoding restarts cleanly there. The exception is mlx-lm's NUL
        // quirk (byte 0 streams as "Ā"), so outputs holding a NUL are not compared.
        let expected = decoded.strip_prefix(' ').unwrap_or(&decoded);
        if !decoded.contains('\0') && joined != expected {
            failures.push(format!(
                "{}: streamed {joined:?}\n  decoded {expected:?}",
                trace.id
            ));
        }
        // Held-back text never leaks: without U+FFFD in decode, no segment has one either.
        if !decoded.contains('\u{fffd}') && segments.iter().any(|s| s.contains('\u{fffd}')) {
            failures.push(format!("{}: a segment split a character", trace.id));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn streaming_never_splits_characters() {
    let tok = Tokenizer::from_dir(&root().join("golden/tokenizer")).expect("fixture loads");
    let text = "Grüße 東京 😀 naïve — café\n東京😀😀x";
    let ids = tok.encode(text, false).expect("encodes");
    // The fixture's small vocabulary must split some character across tokens for this to
    // test anything.
    let split = ids
        .iter()
        .any(|&id| tok.decode(&[id]).expect("decodes").contains('\u{fffd}'));
    assert!(
        split,
        "no multi-byte character was split into several tokens"
    );
    let mut det = tok.detokenizer();
    let segments = stream(&mut det, &ids);
    assert!(
        segments.iter().all(|s| !s.contains('\u{fffd}')),
        "a segment holds a partial character: {segments:?}"
    );
    assert!(
        segments[..ids.len()].iter().any(String::is_empty),
        "nothing was held back"
    );
    assert_eq!(segments.concat(), text);

    // An output ending inside a character is flushed lossily, as Python's errors="replace".
    let cut = ids
        .iter()
        .position(|&id| tok.decode(&[id]).expect("decodes").contains('\u{fffd}'))
        .expect("a split character");
    let mut det = tok.detokenizer();
    let segments = stream(&mut det, &ids[..=cut]);
    assert!(
        segments
            .last()
            .expect("final segment")
            .ends_with('\u{fffd}'),
        "{segments:?}"
    );
    assert_eq!(
        segments.concat(),
        tok.decode(&ids[..=cut]).expect("decodes")
    );
}

#[test]
fn streaming_trims_one_leading_space_like_mlx_lm() {
    let tok = Tokenizer::from_dir(&root().join("golden/tokenizer")).expect("fixture loads");
    let ids = tok.encode("  hello  world\n\n x ", false).expect("encodes");
    let mut det = tok.detokenizer();
    assert_eq!(stream(&mut det, &ids).concat(), " hello  world\n\n x ");
    let again = tok.detokenizer();
    assert_eq!(again.text(), "", "a new detokenizer starts empty");
}

/// A tiny Llama-2-style tokenizer.json (SentencePiece BPE with byte fallback) with the given
/// decoder steps, so the SPM and naive detokenizers get exercised; the golden models are all
/// byte-level.
fn spm_model(name: &str, decoder: Value) -> TempModel {
    let mut vocab = Map::new();
    for special in ["<unk>", "<s>", "</s>"] {
        vocab.insert(special.into(), json!(vocab.len()));
    }
    for byte in 0..=255u8 {
        vocab.insert(format!("<0x{byte:02X}>"), json!(vocab.len()));
    }
    let letters = ('a'..='z').map(String::from);
    for piece in ["▁".to_string()]
        .into_iter()
        .chain(letters)
        .chain(["▁t", "he", "▁the"].map(String::from))
    {
        vocab.insert(piece, json!(vocab.len()));
    }
    let added: Vec<Value> = ["<unk>", "<s>", "</s>"]
        .iter()
        .enumerate()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": decoder},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": [["▁", "t"], ["h", "e"], ["▁t", "he"]]},
    });
    let model = TempModel::empty(name);
    model.write("tokenizer.json", &tokenizer.to_string());
    model.write(
        "tokenizer_config.json",
        r#"{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}"#,
    );
    model
}

#[test]
fn spm_and_naive_streaming_match_mlx_lm() {
    let replace = json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "});
    let (fallback, fuse) = (json!({"type": "ByteFallback"}), json!({"type": "Fuse"}));
    let strip = json!({"type": "Strip", "content": " ", "start": 1, "stop": 0});
    let unicode = "Grüße 東京 😀\nthe end\n\n  x ";
    let leading = " leading space";
    // Decodes and segments are what transformers and mlx-lm 0.32.2 gave for the same
    // tokenizers and texts. Its quirks show:
    // SPM drops every leading space until text appears, and the naive strategy re-emits text
    // when byte fallback revises a line ("üß").
    let cases = [
        (
            "spm",
            json!([replace, fallback, fuse, strip]),
            "the cat",
            json!({
                unicode: ["", "G", "r", "", "ü", "", "ß", "e", " ", "", "", "東", "", "", "京", " ", "", "", "", "😀", "\n", "t", "he", " ", "e", "n", "d", "\n", "\n", " ", " ", "x", " ", ""],
                leading: ["", "", "l", "e", "a", "d", "i", "n", "g", " ", "s", "p", "a", "c", "e", ""],
            }),
        ),
        (
            "spm-nospace",
            json!([replace, fallback, fuse]),
            " the cat",
            json!({
                unicode: [" ", "G", "r", "", "ü", "", "ß", "e", " ", "", "", "東", "", "", "京", " ", "", "", "", "😀", "\n", "t", "he", " ", "e", "n", "d", "\n", "\n", " ", " ", "x", " ", ""],
                leading: [" ", " ", "l", "e", "a", "d", "i", "n", "g", " ", "s", "p", "a", "c", "e", ""],
            }),
        ),
        (
            "naive",
            json!([fallback, replace, fuse, strip]),
            "the cat",
            json!({
                unicode: ["", "G", "r", "", "ü", "", "üß", "e", " ", "", "", "東", "", "", "東京", " ", "", "", "", "😀", "\n", "t", "he", " ", "e", "n", "d", "\n", "\n", "", " ", "x", " ", ""],
                leading: ["", " ", "l", "e", "a", "d", "i", "n", "g", " ", "s", "p", "a", "c", "e", ""],
            }),
        ),
    ];
    for (name, decoder, decoded, expected) in cases {
        let model = spm_model(name, decoder);
        let tok = model.load();
        assert_eq!(tok.bos_token(), Some("<s>"));
        assert_eq!(tok.eos_token_id(), tok.token_to_id("</s>"));
        let with_bos = tok.encode("the cat", true).expect("encodes");
        assert_eq!(
            with_bos.first().copied(),
            tok.token_to_id("<s>"),
            "{name}: bos added"
        );
        assert_eq!(
            tok.decode(&with_bos[1..]).expect("decodes"),
            decoded,
            "{name}"
        );
        for (text, want) in expected.as_object().expect("cases") {
            let ids = tok.encode(text, false).expect("encodes");
            let want: Vec<&str> = want
                .as_array()
                .expect("segments")
                .iter()
                .map(|s| s.as_str().expect("segment"))
                .collect();
            let mut det = tok.detokenizer();
            assert_eq!(stream(&mut det, &ids), want, "{name}: {text:?}");
        }
    }
}

#[test]
fn special_tokens_missing_from_tokenizer_json_are_registered() {
    // As transformers does (checked against it): named, model-specific and extra special tokens
    // that tokenizer.json lacks are added as special tokens, in that order, and become template
    // variables; one that is only a plain vocabulary entry becomes atomic.
    let strip = json!({"type": "Strip", "content": " ", "start": 1, "stop": 0});
    let model = spm_model("missing-specials", json!([strip]));
    let base = model.load().vocab_size();
    let path = model.0.join("tokenizer.json");
    let mut tokenizer: Value =
        serde_json::from_slice(&fs::read(&path).expect("tokenizer.json")).expect("json");
    tokenizer["added_tokens"]
        .as_array_mut()
        .expect("added tokens")
        .retain(|t| t["content"] != "</s>");
    model.write("tokenizer.json", &tokenizer.to_string());
    model.write(
        "tokenizer_config.json",
        &json!({
            "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
            "image_token": "<img>", "extra_special_tokens": {"audio_token": "<aud>"},
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": "{{ image_token }}|{{ audio_token }}|{{ pad_token }}",
        })
        .to_string(),
    );
    let tok = model.load();
    assert_eq!(tok.vocab_size(), base + 3);
    let new_ids: Vec<Option<u32>> = ["<pad>", "<img>", "<aud>"]
        .iter()
        .map(|t| tok.token_to_id(t))
        .collect();
    let expected: Vec<Option<u32>> = (base..base + 3).map(|id| u32::try_from(id).ok()).collect();
    assert_eq!(new_ids, expected);
    let eos = tok.eos_token_id().expect("eos");
    let ids = tok.encode("the</s>cat<pad>x", false).expect("encodes");
    assert!(
        ids.contains(&eos) && ids.contains(&expected[0].expect("pad")),
        "{ids:?}"
    );
    let rendered = tok
        .apply_chat_template(&user(json!("x")), false, &Map::new())
        .expect("renders");
    assert_eq!(rendered, "<img>|<aud>|<pad>");
}

#[test]
fn bad_folders_are_errors_naming_the_path() {
    let missing = root().join("golden/models/no-such-model");
    let err = Tokenizer::from_dir(&missing).err().expect("missing folder");
    assert!(matches!(err, TokenizerError::MissingDir(_)), "{err:?}");
    assert!(err.to_string().contains("no-such-model"), "{err}");

    let model = TempModel::empty("no-tokenizer");
    let err = Tokenizer::from_dir(&model.0)
        .err()
        .expect("no tokenizer.json");
    assert!(matches!(err, TokenizerError::MissingFile(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains(&model.0.join("tokenizer.json").display().to_string()),
        "{err}"
    );

    model.write(
        "tokenizer.json",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}",
    );
    let err = Tokenizer::from_dir(&model.0)
        .err()
        .expect("truncated tokenizer.json");
    assert!(matches!(err, TokenizerError::Json { .. }), "{err:?}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    model.write("tokenizer.json", "{\"model\": 5}");
    let err = Tokenizer::from_dir(&model.0)
        .err()
        .expect("not a tokenizer");
    assert!(matches!(err, TokenizerError::Load { .. }), "{err:?}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    let model = TempModel::with_template("bad-config", "{{ messages }}");
    model.write("tokenizer_config.json", "{\"eos_token\": ");
    let err = Tokenizer::from_dir(&model.0).err().expect("corrupt config");
    assert!(matches!(err, TokenizerError::Json { .. }), "{err:?}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

/// A Qwen3-style template (tools, tool calls and responses, thinking, `namespace`, reversed
/// slicing, string methods, `tojson`).
const QWEN_STYLE_TEMPLATE: &str = r##"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"##;

#[test]
fn qwen_style_template_matches_transformers() {
    let tok = TempModel::with_template("qwen-style", QWEN_STYLE_TEMPLATE).load();
    let case: Value = serde_json::from_str(r##"{"messages": [{"role": "system", "content": "You are <helpful> & 'kind'."}, {"role": "user", "content": "Weather in Zürich?"}, {"role": "assistant", "content": "<think>\nneed tool\n</think>\n\nLet me check.", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "units": ["c", 1.5, null, true], "when": {"day": 1e-05}}}}]}, {"role": "tool", "content": "{\"temp\": 3}"}, {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is 3°C.", "reasoning_content": "done", "tool_calls": null}, {"role": "user", "content": [{"type": "text", "text": "thanks"}]}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get <weather> & stuff", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}"##).expect("case json");
    let messages = case["messages"].as_array().expect("messages").clone();
    let mut with_tools = Map::new();
    with_tools.insert("tools".into(), case["tools"].clone());
    let mut thinking = Map::new();
    thinking.insert("enable_thinking".into(), json!(true));
    // Rendered by transformers 5.24 through mlx-lm's wrapper.
    assert_eq!(
        tok.apply_chat_template(&messages, true, &with_tools)
            .expect("renders"),
        r##"<|im_start|>system
You are <helpful> & 'kind'.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get <weather> & stuff", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Zürich?<|im_end|>
<|im_start|>assistant
<think>
need tool
</think>

Let me check.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Zürich", "units": ["c", 1.5, null, true], "when": {"day": 1e-05}}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temp": 3}
</tool_response>
<tool_response>
sunny
</tool_response><|im_end|>
<|im_start|>assistant
<think>
done
</think>

It is 3°C.<|im_end|>
<|im_start|>user
<|im_end|>
<|im_start|>assistant
<think>

</think>

"##
    );
    assert_eq!(
        tok.apply_chat_template(&messages, false, &Map::new())
            .expect("renders"),
        r##"<|im_start|>system
You are <helpful> & 'kind'.<|im_end|>
<|im_start|>user
Weather in Zürich?<|im_end|>
<|im_start|>assistant
<think>
need tool
</think>

Let me check.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Zürich", "units": ["c", 1.5, null, true], "when": {"day": 1e-05}}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temp": 3}
</tool_response>
<tool_response>
sunny
</tool_response><|im_end|>
<|im_start|>assistant
<think>
done
</think>

It is 3°C.<|im_end|>
<|im_start|>user
<|im_end|>
"##
    );
    assert_eq!(
        tok.apply_chat_template(&messages[..2], true, &thinking)
            .expect("renders"),
        r##"<|im_start|>system
You are <helpful> & 'kind'.<|im_end|>
<|im_start|>user
Weather in Zürich?<|im_end|>
<|im_start|>assistant
"##
    );
}

/// mlx_lm.generate's prompt from a user's text: the chat template with a generation prompt;
/// continuing a prompt cache keeps only what the template adds from the user's message on
/// (the cache holds the rest, system prompt included); a raw turn is the text with special
/// tokens.
#[test]
fn a_user_turn_continuing_a_prompt_cache_is_the_suffix_from_the_user_message_on() {
    let tok = Tokenizer::from_dir(&root().join("golden/tokenizer")).expect("fixture loads");
    let turn = UserTurn {
        text: "What does os.path.join do?",
        system: Some("You are terse."),
        ..UserTurn::default()
    };
    let messages = [
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": turn.text}),
    ];
    let full = tok
        .apply_chat_template(&messages, true, &Map::new())
        .unwrap();
    assert_eq!(
        tok.encode_user_turn(&turn).unwrap(),
        tok.encode(&full, false).unwrap()
    );

    let cached = tok
        .encode_user_turn(&UserTurn {
            continues_cache: true,
            ..turn.clone()
        })
        .unwrap();
    let suffix = tok.decode(&cached).unwrap();
    assert!(suffix.starts_with(turn.text), "{suffix:?}");
    assert!(
        full.ends_with(&suffix),
        "{suffix:?} is not a suffix of {full:?}"
    );
    assert!(!suffix.contains("You are terse."), "{suffix:?}");
    assert!(
        suffix.len() > turn.text.len(),
        "the generation prompt follows the message: {suffix:?}"
    );

    let raw = tok
        .encode_user_turn(&UserTurn {
            raw: true,
            ..turn.clone()
        })
        .unwrap();
    assert_eq!(raw, tok.encode(turn.text, true).unwrap());
}
