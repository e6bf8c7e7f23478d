//! Model folders named by traces and suites (repository-relative), each loaded once, and the
//! one mapping of a trace's or a suite's draft source onto the drafter registry. A folder whose
//! weights are derived is opened as its materialised copy ([`derived`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use verity_harness::acceptance::Source;
use verity_harness::trace::Draft;

use super::derived;
use crate::bundle::ModelBundle;
use crate::speculative::{Drafter, DrafterSpec};
use crate::{validate, Result};

pub struct Models {
    root: PathBuf,
    loaded: HashMap<PathBuf, Rc<ModelBundle>>,
    /// Model folders by their path as named, once resolved (a derived folder is materialised
    /// and hashed once per run).
    folders: HashMap<PathBuf, PathBuf>,
    /// Drafters by the target folder they were paired with and their spec.
    drafters: HashMap<(PathBuf, DrafterSpec), Rc<Drafter>>,
}

impl Models {
    /// `root` is the repository root that model paths are relative to.
    pub fn new(root: &Path) -> Models {
        Models {
            root: root.to_path_buf(),
            loaded: HashMap::new(),
            folders: HashMap::new(),
            drafters: HashMap::new(),
        }
    }

    /// A path relative to the repository root.
    pub fn path(&self, relative: &str) -> PathBuf {
        self.root.join(relative)
    }

    /// A repository-relative model folder as it loads: itself, or the materialised copy of a
    /// derived one under `<root>/target/derived-models`.
    fn folder(&mut self, relative: &str) -> Result<PathBuf> {
        let named = self.path(relative);
        if let Some(dir) = self.folders.get(&named) {
            return Ok(dir.clone());
        }
        let dir = derived::resolve(&named, &self.root.join(derived::CACHE))?;
        self.folders.insert(named, dir.clone());
        Ok(dir)
    }

    /// The bundle of a repository-relative model folder, loaded on first use.
    pub fn get(&mut self, relative: &str) -> Result<Rc<ModelBundle>> {
        let dir = self.folder(relative)?;
        if let Some(m) = self.loaded.get(&dir) {
            return Ok(Rc::clone(m));
        }
        let m = Rc::new(ModelBundle::load(&dir)?);
        self.loaded.insert(dir, Rc::clone(&m));
        Ok(m)
    }

    /// The drafter `spec` names, paired with the repository-relative `target`, loaded on
    /// first use.
    pub fn drafter(&mut self, target: &str, spec: &DrafterSpec) -> Result<Rc<Drafter>> {
        let key = (self.path(target), spec.clone());
        if let Some(d) = self.drafters.get(&key) {
            return Ok(Rc::clone(d));
        }
        let target = self.get(target)?;
        let d = Rc::new(Drafter::load(spec, &target)?);
        self.drafters.insert(key, Rc::clone(&d));
        Ok(d)
    }

    /// The drafter a trace was recorded with and its drafts per round (mlx-vlm's block is the
    /// round's verify input: the last token and its drafts).
    pub fn trace_drafter(&mut self, draft: &Draft) -> Result<(DrafterSpec, usize)> {
        Ok(match draft {
            Draft::Model {
                model,
                num_draft_tokens,
            } => (DrafterSpec::Model(self.folder(model)?), *num_draft_tokens),
            Draft::Mtp { block_size, model } => {
                validate::draft_block_size(*block_size)?;
                let dir = match model {
                    Some(model) => Some(self.folder(model)?),
                    None => None,
                };
                (DrafterSpec::Mtp { dir }, block_size - 1)
            }
            Draft::Dflash { model, block_size } => {
                validate::draft_block_size(*block_size)?;
                let dir = self.folder(model)?;
                (DrafterSpec::Dflash { dir, chain: false }, block_size - 1)
            }
        })
    }

    /// The drafter an acceptance suite runs.
    pub fn suite_drafter(&mut self, source: &Source) -> Result<DrafterSpec> {
        Ok(match source {
            Source::Model { model } => DrafterSpec::Model(self.folder(model)?),
            &Source::Ngram { min, max } => DrafterSpec::Ngram { min, max },
            Source::Mtp => DrafterSpec::Mtp { dir: None },
            Source::Dflash { model, chain } => DrafterSpec::Dflash {
                dir: self.folder(model)?,
                chain: *chain,
            },
        })
    }
}
