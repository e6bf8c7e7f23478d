//! Model folders named by traces and suites (repository-relative), each loaded once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::bundle::ModelBundle;
use crate::model::dflash::DflashModel;
use crate::Result;

pub struct Models {
    root: PathBuf,
    loaded: HashMap<PathBuf, Rc<ModelBundle>>,
    drafters: HashMap<PathBuf, Rc<DflashModel>>,
}

impl Models {
    /// `root` is the repository root that model paths are relative to.
    pub fn new(root: &Path) -> Models {
        Models {
            root: root.to_path_buf(),
            loaded: HashMap::new(),
            drafters: HashMap::new(),
        }
    }

    /// A path relative to the repository root.
    pub fn path(&self, relative: &str) -> PathBuf {
        self.root.join(relative)
    }

    /// The bundle of a repository-relative model folder, loaded on first use.
    pub fn get(&mut self, relative: &str) -> Result<Rc<ModelBundle>> {
        let dir = self.path(relative);
        if let Some(m) = self.loaded.get(&dir) {
            return Ok(Rc::clone(m));
        }
        let m = Rc::new(ModelBundle::load(&dir)?);
        self.loaded.insert(dir, Rc::clone(&m));
        Ok(m)
    }

    /// A repository-relative DFlash drafter folder, loaded on first use.
    pub fn dflash(&mut self, relative: &str) -> Result<Rc<DflashModel>> {
        let dir = self.path(relative);
        if let Some(m) = self.drafters.get(&dir) {
            return Ok(Rc::clone(m));
        }
        let m = Rc::new(DflashModel::load(&dir)?);
        self.drafters.insert(dir, Rc::clone(&m));
        Ok(m)
    }
}
