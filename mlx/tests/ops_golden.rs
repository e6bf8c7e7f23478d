//! Every bound op against values recorded from Python MLX by oracles/record_ops.py
//! (golden/ops): same dtype, same shape, same bits.

use std::collections::BTreeMap;
use std::path::PathBuf;

use mlx::fast::{RopeFreqs, SdpaMask};
use mlx::random::KeySequence;
use mlx::{compiled, fast, ops, random, Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
struct Cases {
    format: String,
    mlx_version: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    op: String,
    args: BTreeMap<String, Value>,
    inputs: Vec<String>,
    outputs: Vec<String>,
}

struct Args<'a>(&'a BTreeMap<String, Value>);

impl Args<'_> {
    fn get(&self, key: &str) -> &Value {
        self.0
            .get(key)
            .unwrap_or_else(|| panic!("case lacks argument {key}"))
    }
    fn i32(&self, key: &str) -> i32 {
        self.get(key).as_i64().expect("integer") as i32
    }
    fn u64(&self, key: &str) -> u64 {
        self.get(key).as_u64().expect("unsigned integer")
    }
    fn f32(&self, key: &str) -> f32 {
        self.get(key).as_f64().expect("number") as f32
    }
    fn bool(&self, key: &str) -> bool {
        self.get(key).as_bool().expect("bool")
    }
    fn str(&self, key: &str) -> &str {
        self.get(key).as_str().expect("string")
    }
    fn ints(&self, key: &str) -> Vec<i32> {
        let list = self.get(key).as_array().expect("list");
        list.iter()
            .map(|v| v.as_i64().expect("integer") as i32)
            .collect()
    }
    fn dtype(&self, key: &str) -> Dtype {
        Dtype::from_name(self.str(key)).expect("known dtype")
    }
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/ops")
}

type Reduction = fn(&Array, &[i32], bool) -> mlx::Result<Array>;

/// Runs one case through the binding.
fn run(op: &str, a: &Args, x: &[Array]) -> mlx::Result<Vec<Array>> {
    let one = |r: mlx::Result<Array>| r.map(|a| vec![a]);
    let unary: Option<fn(&Array) -> mlx::Result<Array>> = match op {
        "negative" => Some(ops::negative),
        "abs" => Some(ops::abs),
        "exp" => Some(ops::exp),
        "expm1" => Some(ops::expm1),
        "log" => Some(ops::log),
        "log1p" => Some(ops::log1p),
        "sqrt" => Some(ops::sqrt),
        "rsqrt" => Some(ops::rsqrt),
        "square" => Some(ops::square),
        "reciprocal" => Some(ops::reciprocal),
        "sigmoid" => Some(ops::sigmoid),
        "tanh" => Some(ops::tanh),
        "sin" => Some(ops::sin),
        "cos" => Some(ops::cos),
        "erf" => Some(ops::erf),
        "floor" => Some(ops::floor),
        "ceil" => Some(ops::ceil),
        "round" => Some(ops::round),
        "sign" => Some(ops::sign),
        "logical_not" => Some(ops::logical_not),
        "isnan" => Some(ops::isnan),
        "stop_gradient" => Some(ops::stop_gradient),
        "compiled_silu" => Some(compiled::silu),
        "compiled_gelu_approx" => Some(compiled::gelu_approx),
        "compiled_softplus" => Some(compiled::softplus),
        "compiled_sigmoid" => Some(compiled::sigmoid),
        _ => None,
    };
    if let Some(f) = unary {
        return one(f(&x[0]));
    }
    let binary: Option<fn(&Array, &Array) -> mlx::Result<Array>> = match op {
        "add" => Some(ops::add),
        "subtract" => Some(ops::subtract),
        "multiply" => Some(ops::multiply),
        "divide" => Some(ops::divide),
        "power" => Some(ops::power),
        "maximum" => Some(ops::maximum),
        "minimum" => Some(ops::minimum),
        "remainder" => Some(ops::remainder),
        "floor_divide" => Some(ops::floor_divide),
        "logaddexp" => Some(ops::logaddexp),
        "equal" => Some(ops::equal),
        "not_equal" => Some(ops::not_equal),
        "less" => Some(ops::less),
        "less_equal" => Some(ops::less_equal),
        "greater" => Some(ops::greater),
        "greater_equal" => Some(ops::greater_equal),
        "logical_and" => Some(ops::logical_and),
        "logical_or" => Some(ops::logical_or),
        "matmul" => Some(ops::matmul),
        "compiled_swiglu" => Some(compiled::swiglu),
        _ => None,
    };
    if let Some(f) = binary {
        return one(f(&x[0], &x[1]));
    }
    let reduce: Option<Reduction> = match op {
        "sum" => Some(ops::sum),
        "mean" => Some(ops::mean),
        "prod" => Some(ops::prod),
        "max" => Some(ops::max),
        "min" => Some(ops::min),
        "logsumexp" => Some(ops::logsumexp),
        "all" => Some(ops::all),
        "any" => Some(ops::any),
        _ => None,
    };
    if let Some(f) = reduce {
        return one(f(&x[0], &a.ints("axes"), a.bool("keepdims")));
    }
    match op {
        "addmm" => one(ops::addmm(
            &x[0],
            &x[1],
            &x[2],
            a.f32("alpha"),
            a.f32("beta"),
        )),
        "argmax" => one(ops::argmax(&x[0], a.i32("axis"), a.bool("keepdims"))),
        "argmin" => one(ops::argmin(&x[0], a.i32("axis"), a.bool("keepdims"))),
        "where" => one(ops::r#where(&x[0], &x[1], &x[2])),
        "clip" => one(ops::clip(&x[0], Some(&x[1]), Some(&x[2]))),
        "astype" => one(x[0].astype(a.dtype("dtype"))),
        "softmax" => one(ops::softmax(&x[0], &a.ints("axes"), a.bool("precise"))),
        "cumsum" => one(ops::cumsum(
            &x[0],
            a.i32("axis"),
            a.bool("reverse"),
            a.bool("inclusive"),
        )),
        "reshape" => one(x[0].reshape(&a.ints("shape"))),
        "transpose" => one(x[0].transpose(&a.ints("axes"))),
        "expand_dims" => one(x[0].expand_dims(&a.ints("axes"))),
        "squeeze" => one(x[0].squeeze(&a.ints("axes"))),
        "broadcast_to" => one(x[0].broadcast_to(&a.ints("shape"))),
        "flatten" => one(x[0].flatten(a.i32("start"), a.i32("end"))),
        "moveaxis" => one(x[0].moveaxis(a.i32("source"), a.i32("destination"))),
        "slice" => one(x[0].slice(&a.ints("start"), &a.ints("stop"), &a.ints("strides"))),
        "slice_update" => {
            one(x[0].slice_update(&x[1], &a.ints("start"), &a.ints("stop"), &a.ints("strides")))
        }
        "concatenate" => one(ops::concatenate(
            &x.iter().collect::<Vec<_>>(),
            a.i32("axis"),
        )),
        "stack" => one(ops::stack(&x.iter().collect::<Vec<_>>(), a.i32("axis"))),
        "split_sections" => ops::split_sections(&x[0], &a.ints("indices"), a.i32("axis")),
        "split" => ops::split(&x[0], a.i32("parts"), a.i32("axis")),
        "repeat" => one(x[0].repeat(a.i32("repeats"), a.i32("axis"))),
        "pad" => one(ops::pad(
            &x[0],
            &a.ints("axes"),
            &a.ints("low"),
            &a.ints("high"),
            &x[1],
        )),
        "take" => one(x[0].take(&x[1], a.i32("axis"))),
        "take_along_axis" => one(ops::take_along_axis(&x[0], &x[1], a.i32("axis"))),
        "put_along_axis" => one(ops::put_along_axis(&x[0], &x[1], &x[2], a.i32("axis"))),
        "scatter" => one(ops::scatter(&x[0], &[&x[1]], &x[2], &a.ints("axes"))),
        "scatter_add" => one(ops::scatter_add(&x[0], &[&x[1]], &x[2], &a.ints("axes"))),
        "sort" => one(ops::sort(&x[0], a.i32("axis"))),
        "argsort" => one(ops::argsort(&x[0], a.i32("axis"))),
        "argpartition" => one(ops::argpartition(&x[0], a.i32("kth"), a.i32("axis"))),
        "topk" => one(ops::topk(&x[0], a.i32("k"), a.i32("axis"))),
        "tril" => one(ops::tril(&x[0], a.i32("k"))),
        "conv1d" => one(ops::conv1d(
            &x[0],
            &x[1],
            a.i32("stride"),
            a.i32("padding"),
            a.i32("dilation"),
            a.i32("groups"),
        )),
        "quantize" => ops::quantize(&x[0], a.i32("group_size"), a.i32("bits"), a.str("mode")),
        "dequantize" => one(ops::dequantize(
            &x[0],
            &x[1],
            Some(&x[2]),
            a.i32("group_size"),
            a.i32("bits"),
            a.str("mode"),
        )),
        "quantized_matmul" => one(ops::quantized_matmul(
            &x[0],
            &x[1],
            &x[2],
            Some(&x[3]),
            a.bool("transpose"),
            a.i32("group_size"),
            a.i32("bits"),
            a.str("mode"),
        )),
        "rms_norm" => one(fast::rms_norm(&x[0], x.get(1), a.f32("eps"))),
        "layer_norm" => one(fast::layer_norm(&x[0], x.get(1), x.get(2), a.f32("eps"))),
        "rope" => {
            let freqs = match x.get(1) {
                Some(f) => RopeFreqs::Freqs(f),
                None => RopeFreqs::Base(a.f32("base")),
            };
            let (dims, trad) = (a.i32("dims"), a.bool("traditional"));
            one(fast::rope(
                &x[0],
                dims,
                trad,
                freqs,
                a.f32("scale"),
                a.i32("offset"),
            ))
        }
        "sdpa" => {
            let mask = match a.str("mask") {
                "none" => SdpaMask::None,
                "causal" => SdpaMask::Causal,
                _ => SdpaMask::Array(&x[3]),
            };
            one(fast::scaled_dot_product_attention(
                &x[0],
                &x[1],
                &x[2],
                a.f32("scale"),
                mask,
                None,
            ))
        }
        "random_key" => one(random::key(a.u64("seed"))),
        "random_split" => one(random::split(&x[0], a.i32("num"))),
        "random_uniform" => one(random::uniform(&a.ints("shape"), a.dtype("dtype"), &x[0])),
        "random_normal" => one(random::normal(&a.ints("shape"), a.dtype("dtype"), &x[0])),
        "random_gumbel" => one(random::gumbel(&a.ints("shape"), a.dtype("dtype"), &x[0])),
        "random_categorical" => one(random::categorical(&x[0], a.i32("axis"), &x[1])),
        "compiled_precise_swiglu" => one(compiled::precise_swiglu(&x[0], &x[1], &x[2])),
        "compiled_compute_g" => one(compiled::compute_g(&x[0], &x[1], &x[2])),
        "compiled_gated_delta_step" => {
            let (y, s) = compiled::gated_delta_step(&x[0], &x[1], &x[2], &x[3], &x[4], &x[5])?;
            Ok(vec![y, s])
        }
        "key_sequence" => {
            let mut keys = KeySequence::new(a.u64("seed"))?;
            let mut out = Vec::new();
            for _ in 0..4 {
                out.push(random::categorical(&x[0], -1, &keys.next_key()?)?);
            }
            out.push(random::uniform(&[2], Dtype::Float32, &keys.next_key()?)?);
            Ok(out)
        }
        other => panic!("ops golden names an op this test does not know: {other}"),
    }
}

#[test]
fn every_bound_op_matches_python_mlx_bit_for_bit() {
    // golden/ops holds the CPU backend's bits.
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let dir = golden_dir();
    let text = std::fs::read_to_string(dir.join("cases.json")).expect("golden/ops/cases.json");
    let doc: Cases = serde_json::from_str(&text).expect("cases.json parses");
    assert_eq!(doc.format, "verity-ops/1");
    assert_eq!(
        doc.mlx_version,
        mlx::PINNED_VERSION,
        "ops golden recorded with another MLX"
    );
    let tensors = mlx::io::load_safetensors(&dir.join("ops.safetensors"))
        .unwrap()
        .tensors;
    let tensor = |name: &str| {
        tensors
            .get(name)
            .unwrap_or_else(|| panic!("no tensor {name}"))
    };

    let mut failures = Vec::new();
    for case in &doc.cases {
        let inputs: Vec<Array> = case.inputs.iter().map(|n| tensor(n).clone()).collect();
        let got = match run(&case.op, &Args(&case.args), &inputs) {
            Ok(got) => got,
            Err(e) => {
                failures.push(format!("{}: error {e}", case.name));
                continue;
            }
        };
        if got.len() != case.outputs.len() {
            failures.push(format!(
                "{}: {} outputs, want {}",
                case.name,
                got.len(),
                case.outputs.len()
            ));
            continue;
        }
        for (g, name) in got.iter().zip(&case.outputs) {
            let want = tensor(name);
            let same = g.dtype() == want.dtype()
                && g.shape() == want.shape()
                && g.to_bytes().unwrap() == want.to_bytes().unwrap();
            if !same {
                failures.push(format!(
                    "{}: got {:?} want {:?}{}",
                    case.name,
                    g,
                    want,
                    if g.dtype() == want.dtype() && g.shape() == want.shape() {
                        " (bits differ)"
                    } else {
                        ""
                    }
                ));
            }
        }
    }
    assert!(
        doc.cases.len() >= 100,
        "ops golden has only {} cases",
        doc.cases.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        doc.cases.len(),
        failures.join("\n")
    );
}

#[test]
fn safetensors_save_then_load_round_trips() {
    let dir = std::env::temp_dir().join(format!("verity-mlx-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.safetensors");
    let mut tensors = BTreeMap::new();
    tensors.insert(
        "a".to_string(),
        Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap(),
    );
    tensors.insert(
        "b.c".to_string(),
        Array::from_slice(&[7i32, 8], &[1, 2]).unwrap(),
    );
    let meta = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
    mlx::io::save_safetensors(&path, &tensors, &meta).unwrap();
    let back = mlx::io::load_safetensors(&path).unwrap();
    assert_eq!(back.metadata, meta);
    assert_eq!(
        back.tensors["a"].to_vec::<f32>().unwrap(),
        vec![1.0, 2.0, 3.0]
    );
    assert_eq!(back.tensors["b.c"].shape(), vec![1, 2]);
    assert_eq!(back.tensors["b.c"].to_vec::<i32>().unwrap(), vec![7, 8]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn loading_a_missing_file_is_an_error_naming_it() {
    let err = match mlx::io::load_safetensors(std::path::Path::new("/nonexistent/x.safetensors")) {
        Ok(_) => panic!("loaded a missing file"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("/nonexistent/x.safetensors"), "{err}");
}
