//! A long prefill chunk is enqueued a group of layers at a time (generate.rs), which bounds the
//! memory its transient buffers hold on a GPU. The caches it leaves must equal, bit for bit,
//! those of the same chunk enqueued at once.

mod support;

use support::bundle;
use verity::cache::{eval_state, LayerCache};
use verity::generate::{forward_tokens, prefill, token_array, GenerateParams};

fn state_bytes(caches: &[LayerCache]) -> Vec<Vec<u8>> {
    caches
        .iter()
        .flat_map(|c| c.state())
        .map(|a| a.to_bytes().unwrap())
        .collect()
}

#[test]
fn prefill_by_groups_of_layers_equals_one_enqueue() {
    support::on_cpu();
    // Four layers each (a 1024-token chunk goes in two groups of two); gemma3 alternates
    // sliding-window and global layers.
    for fixture in ["qwen3-target", "gemma3"] {
        let bundle = bundle(fixture);
        let model = bundle.model();
        let vocab = model.outer().vocab() as u32;
        let prompt: Vec<u32> = (0..1024u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let tokens = token_array(&prompt).unwrap();
        let params = GenerateParams {
            prefill_step_size: 1024,
            ..GenerateParams::greedy(1, Vec::new())
        };

        let mut grouped = model.make_cache(None);
        prefill(model, &mut grouped, &tokens, &params, |_| Ok(())).unwrap();
        let mut at_once = model.make_cache(None);
        forward_tokens(model, &mut at_once, &tokens, None).unwrap();
        eval_state(&at_once).unwrap();

        let offsets = |caches: &[LayerCache]| caches.iter().map(|c| c.offset()).collect::<Vec<_>>();
        assert_eq!(offsets(&grouped), offsets(&at_once), "{fixture}: offsets");
        assert!(
            state_bytes(&grouped) == state_bytes(&at_once),
            "{fixture}: the grouped prefill left other cache bits"
        );
    }
}
