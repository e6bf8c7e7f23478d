//! A model folder loaded for use: the model, its tokenizer, the EOS set mlx-lm stops on, and
//! (built on first use) the grammar token environment over the same tokenizer.

use std::cell::OnceCell;
use std::path::{Path, PathBuf};

use crate::grammar::{Constraint, Grammar, TokenEnv};
use crate::load::Config;
use crate::model::{self, LanguageModel};
use crate::tokenizer::Tokenizer;
use crate::Result;

pub struct ModelBundle {
    pub dir: PathBuf,
    pub model: Box<dyn LanguageModel>,
    pub config: Config,
    pub tokenizer: Tokenizer,
    /// mlx-lm's TokenizerWrapper eos set: config eos ids, then the tokenizer's eos token.
    pub eos_token_ids: Vec<u32>,
    token_env: OnceCell<TokenEnv>,
}

impl ModelBundle {
    /// Loads config, weights and tokenizer of a model folder.
    pub fn load(dir: &Path) -> Result<ModelBundle> {
        let (model, config) = model::load(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let mut eos_token_ids = config.eos_token_ids()?;
        if let Some(id) = tokenizer.eos_token_id() {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        // The tokenizer's ids index the embedding: one it can produce past the last row would
        // read outside it.
        let (rows, tokens) = (model.vocab_size(), tokenizer.vocab_size());
        if tokens > rows {
            return Err(config
                .error(format!(
                    "the tokenizer has {tokens} tokens but the embedding only {rows} rows"
                ))
                .into());
        }
        if let Some(&id) = eos_token_ids.iter().find(|&&id| id as usize >= rows) {
            return Err(config
                .error(format!(
                    "eos token id {id} is past the vocabulary ({rows} tokens)"
                ))
                .into());
        }
        Ok(ModelBundle {
            dir: dir.to_path_buf(),
            model,
            config,
            tokenizer,
            eos_token_ids,
            token_env: OnceCell::new(),
        })
    }

    pub fn model(&self) -> &dyn LanguageModel {
        self.model.as_ref()
    }

    /// The context the model was trained for (max_position_embeddings), when its config
    /// names one.
    pub fn context_length(&self) -> Option<usize> {
        let json = &self.config.json;
        json.get("max_position_embeddings")
            .or_else(|| json.get("text_config")?.get("max_position_embeddings"))
            .and_then(serde_json::Value::as_u64)
            .map(|c| c as usize)
    }

    /// The tokens XTC never excludes: a newline and the EOS set (mlx_lm.generate and
    /// mlx_lm.server, server.py:497).
    pub fn xtc_special_tokens(&self) -> Result<Vec<u32>> {
        let mut tokens = self.tokenizer.encode("\n", false)?;
        tokens.extend(&self.eos_token_ids);
        Ok(tokens)
    }

    /// Token ids to text, for reports (an undecodable id is shown, not an error).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer
            .decode(ids)
            .unwrap_or_else(|e| format!("<undecodable: {e}>"))
    }

    /// Loads the model folder `dir` as a draft model for this target, refusing it unless both
    /// index the same vocabulary with the same tokenizer (drafts are fed to the target as ids).
    /// The tokenizer and the config's vocabulary size are checked before any weight is read,
    /// so a draft that cannot fit costs nothing; the embedding is checked again once loaded.
    pub fn load_draft(&self, dir: &Path) -> Result<ModelBundle> {
        let config = crate::load::load_config(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        self.check_draft_tokenizer(dir, &tokenizer)?;
        let json = &config.json;
        let declared = json
            .get("vocab_size")
            .or_else(|| json.get("text_config")?.get("vocab_size"))
            .and_then(serde_json::Value::as_u64);
        let rows = self.model.vocab_size();
        if let Some(v) = declared.filter(|&v| v != rows as u64) {
            return Err(crate::error::invalid(
                "the draft model's vocabulary size",
                v,
                &format!("must equal the target's, {rows}"),
            ));
        }
        let draft = ModelBundle::load(dir)?;
        self.check_draft(&draft)?;
        Ok(draft)
    }

    fn check_draft_tokenizer(&self, dir: &Path, tokenizer: &Tokenizer) -> Result<()> {
        self.check_tokenizer_of("the draft model", dir, tokenizer)
    }

    fn check_tokenizer_of(&self, what: &str, dir: &Path, tokenizer: &Tokenizer) -> Result<()> {
        if self.tokenizer.same_vocabulary(tokenizer) {
            return Ok(());
        }
        Err(crate::Error::Params(format!(
            "{what} {} has another tokenizer than {} (its token ids mean other text)",
            dir.display(),
            self.dir.display()
        )))
    }

    /// A drafter folder that ships a tokenizer (mlx-vlm's split MTP folders copy the source's)
    /// must ship this one's; a folder without one borrows the target's.
    pub fn check_drafter_tokenizer(&self, dir: &Path) -> Result<()> {
        if !dir.join("tokenizer.json").is_file() {
            return Ok(());
        }
        self.check_tokenizer_of("the MTP drafter", dir, &Tokenizer::from_dir(dir)?)
    }

    fn check_draft(&self, draft: &ModelBundle) -> Result<()> {
        crate::validate::draft_vocabulary(self.model(), draft.model())?;
        self.check_draft_tokenizer(&draft.dir, &draft.tokenizer)
    }

    /// llguidance's view of the tokenizer, built once.
    pub fn token_env(&self) -> Result<&TokenEnv> {
        if let Some(env) = self.token_env.get() {
            return Ok(env);
        }
        let eos = self
            .tokenizer
            .eos_token_id()
            .or_else(|| self.eos_token_ids.first().copied())
            .unwrap_or(0);
        let env = TokenEnv::new(&self.tokenizer, eos, self.model.vocab_size())?;
        Ok(self.token_env.get_or_init(|| env))
    }

    /// A fresh constraint for `grammar` over this model's tokenizer and EOS set.
    pub fn constraint(&self, grammar: &Grammar) -> Result<Constraint> {
        Ok(self.token_env()?.constraint(grammar, &self.eos_token_ids)?)
    }
}
