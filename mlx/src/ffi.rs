//! The cxx bridge to MLX's C++ API. Every function that can reach MLX returns `Result`, so a C++
//! exception becomes a Rust error carrying MLX's message instead of aborting the process.
//! Optional array arguments are raw pointers (null = absent); the safe wrappers own that detail.

#[allow(clippy::too_many_arguments)] // the bridge mirrors MLX signatures as they are
#[cxx::bridge(namespace = "verity_mlx")]
pub(crate) mod bridge {
    /// Element-wise operations of one argument.
    #[repr(u8)]
    enum UnaryOp {
        Negative,
        Abs,
        Exp,
        Expm1,
        Log,
        Log1p,
        Sqrt,
        Rsqrt,
        Square,
        Reciprocal,
        Sigmoid,
        Tanh,
        Sin,
        Cos,
        Erf,
        Floor,
        Ceil,
        Round,
        Sign,
        LogicalNot,
        IsNan,
        StopGradient,
        Contiguous,
    }

    /// Element-wise (broadcasting) operations of two arguments, and matmul.
    #[repr(u8)]
    enum BinaryOp {
        Add,
        Subtract,
        Multiply,
        Divide,
        Power,
        Maximum,
        Minimum,
        Remainder,
        FloorDivide,
        LogAddExp,
        Equal,
        NotEqual,
        Less,
        LessEqual,
        Greater,
        GreaterEqual,
        LogicalAnd,
        LogicalOr,
        Matmul,
    }

    /// Reductions over a list of axes (an empty list means every axis).
    #[repr(u8)]
    enum ReduceOp {
        Sum,
        Mean,
        Prod,
        Max,
        Min,
        LogSumExp,
        All,
        Any,
        /// The population standard deviation (ddof 0), `mx.std`'s default.
        Std,
    }

    /// Functions defined in the shim and wrapped in `mx::compile`, mirroring the functions that
    /// mlx-lm and mlx.nn compile (see shim.cc for each one's Python original).
    #[repr(u8)]
    enum Kernel {
        Silu,
        Swiglu,
        GeluApprox,
        Softplus,
        Sigmoid,
        PreciseSwiglu,
        ComputeG,
        GatedDeltaStep,
        Geglu,
        LogitSoftcap,
    }

    unsafe extern "C++" {
        include!("mlx/include/shim.h");

        type Array;
        type ArrayList;

        // Lists of arrays (eval, concatenate, split, multi-output ops).
        fn list_new() -> UniquePtr<ArrayList>;
        fn list_push(list: Pin<&mut ArrayList>, a: &Array);
        fn list_len(list: &ArrayList) -> usize;
        fn list_get(list: &ArrayList, i: usize) -> Result<UniquePtr<Array>>;

        // Construction, inspection, copy-out.
        fn from_bytes(data: &[u8], shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn scalar_float(value: f32, dtype: u8) -> Result<UniquePtr<Array>>;
        fn scalar_int(value: i64, dtype: u8) -> Result<UniquePtr<Array>>;
        fn full(shape: &[i32], value: &Array, dtype: u8) -> Result<UniquePtr<Array>>;
        fn zeros(shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: u8) -> Result<UniquePtr<Array>>;
        fn clone_array(a: &Array) -> UniquePtr<Array>;
        fn shape(a: &Array) -> Vec<i32>;
        fn dtype(a: &Array) -> u8;
        fn to_bytes(a: &Array) -> Result<Vec<u8>>;
        fn describe(a: &Array) -> String;

        // Evaluation and memory.
        fn eval(list: &ArrayList) -> Result<()>;
        fn async_eval(list: &ArrayList) -> Result<()>;
        fn peak_memory() -> usize;
        fn reset_peak_memory();
        fn clear_cache();
        fn version() -> String;
        fn use_cpu() -> Result<()>;
        fn use_gpu() -> Result<()>;
        fn default_is_cpu() -> bool;
        fn gpu_available() -> bool;
        fn cuda_available() -> bool;
        fn metal_available() -> bool;

        // Generic element-wise ops and reductions.
        fn unary(op: UnaryOp, a: &Array) -> Result<UniquePtr<Array>>;
        fn binary(op: BinaryOp, a: &Array, b: &Array) -> Result<UniquePtr<Array>>;
        fn reduce(
            op: ReduceOp,
            a: &Array,
            axes: &[i32],
            keepdims: bool,
        ) -> Result<UniquePtr<Array>>;
        fn argmax(a: &Array, axis: i32, keepdims: bool) -> Result<UniquePtr<Array>>;
        fn argmin(a: &Array, axis: i32, keepdims: bool) -> Result<UniquePtr<Array>>;
        fn where_(cond: &Array, x: &Array, y: &Array) -> Result<UniquePtr<Array>>;
        unsafe fn clip(a: &Array, lo: *const Array, hi: *const Array) -> Result<UniquePtr<Array>>;
        fn astype(a: &Array, dtype: u8) -> Result<UniquePtr<Array>>;
        fn softmax(a: &Array, axes: &[i32], precise: bool) -> Result<UniquePtr<Array>>;
        fn cumsum(a: &Array, axis: i32, reverse: bool, inclusive: bool)
            -> Result<UniquePtr<Array>>;
        fn addmm(
            c: &Array,
            a: &Array,
            b: &Array,
            alpha: f32,
            beta: f32,
        ) -> Result<UniquePtr<Array>>;

        // Shapes, indexing, joining.
        fn reshape(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn transpose(a: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn expand_dims(a: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn squeeze(a: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn broadcast_to(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn flatten(a: &Array, start: i32, end: i32) -> Result<UniquePtr<Array>>;
        fn moveaxis(a: &Array, source: i32, destination: i32) -> Result<UniquePtr<Array>>;
        fn slice(
            a: &Array,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn slice_update(
            src: &Array,
            update: &Array,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn concatenate(list: &ArrayList, axis: i32) -> Result<UniquePtr<Array>>;
        fn depends(input: &Array, dependency: &Array) -> Result<UniquePtr<Array>>;
        fn stack(list: &ArrayList, axis: i32) -> Result<UniquePtr<Array>>;
        fn split_sections(a: &Array, indices: &[i32], axis: i32) -> Result<UniquePtr<ArrayList>>;
        fn split_equal(a: &Array, parts: i32, axis: i32) -> Result<UniquePtr<ArrayList>>;
        fn repeat(a: &Array, repeats: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn pad(
            a: &Array,
            axes: &[i32],
            low: &[i32],
            high: &[i32],
            value: &Array,
        ) -> Result<UniquePtr<Array>>;
        fn take(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn take_along_axis(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn put_along_axis(
            a: &Array,
            indices: &Array,
            values: &Array,
            axis: i32,
        ) -> Result<UniquePtr<Array>>;
        fn scatter(
            a: &Array,
            indices: &ArrayList,
            updates: &Array,
            axes: &[i32],
            add: bool,
        ) -> Result<UniquePtr<Array>>;
        fn sort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn argsort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn argpartition(a: &Array, kth: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn topk(a: &Array, k: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn tril(a: &Array, k: i32) -> Result<UniquePtr<Array>>;

        // Convolution and quantization.
        fn conv1d(
            input: &Array,
            weight: &Array,
            stride: i32,
            padding: i32,
            dilation: i32,
            groups: i32,
        ) -> Result<UniquePtr<Array>>;
        fn quantize(
            w: &Array,
            group_size: i32,
            bits: i32,
            mode: &str,
        ) -> Result<UniquePtr<ArrayList>>;
        unsafe fn dequantize(
            w: &Array,
            scales: &Array,
            biases: *const Array,
            group_size: i32,
            bits: i32,
            mode: &str,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn quantized_matmul(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: *const Array,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: &str,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn gather_qmm(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: *const Array,
            rhs_indices: &Array,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: &str,
            sorted_indices: bool,
        ) -> Result<UniquePtr<Array>>;
        fn gather_mm(
            a: &Array,
            b: &Array,
            rhs_indices: &Array,
            sorted_indices: bool,
        ) -> Result<UniquePtr<Array>>;

        // mx::fast.
        unsafe fn rms_norm(x: &Array, weight: *const Array, eps: f32) -> Result<UniquePtr<Array>>;
        unsafe fn layer_norm(
            x: &Array,
            weight: *const Array,
            bias: *const Array,
            eps: f32,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn rope(
            x: &Array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offset: i32,
            freqs: *const Array,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn rope_at(
            x: &Array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offsets: &Array,
            freqs: *const Array,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn scaled_dot_product_attention(
            queries: &Array,
            keys: &Array,
            values: &Array,
            scale: f32,
            mask_mode: &str,
            mask: *const Array,
            sinks: *const Array,
        ) -> Result<UniquePtr<Array>>;

        fn rows_attention(
            queries: &Array,
            keys: &Array,
            values: &Array,
            slots: &Array,
            extents: &Array,
            one_pass_scale_log2: f32,
            two_pass_scale_log2: f32,
            two_pass: bool,
        ) -> Result<UniquePtr<Array>>;

        fn rows_qmv(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: &Array,
            group_size: i32,
            bits: i32,
            rows: i32,
            ahead: i32,
        ) -> Result<UniquePtr<Array>>;

        // mx::random, always with an explicit key (see random.rs).
        fn random_key(seed: u64) -> Result<UniquePtr<Array>>;
        fn random_split(key: &Array, num: i32) -> Result<UniquePtr<Array>>;
        fn random_uniform(shape: &[i32], dtype: u8, key: &Array) -> Result<UniquePtr<Array>>;
        fn random_normal(shape: &[i32], dtype: u8, key: &Array) -> Result<UniquePtr<Array>>;
        fn random_gumbel(shape: &[i32], dtype: u8, key: &Array) -> Result<UniquePtr<Array>>;
        fn random_categorical(logits: &Array, axis: i32, key: &Array) -> Result<UniquePtr<Array>>;

        // Safetensors.
        fn load_safetensors(
            path: &str,
            names: &mut Vec<String>,
            meta_keys: &mut Vec<String>,
            meta_values: &mut Vec<String>,
        ) -> Result<UniquePtr<ArrayList>>;
        fn save_safetensors(
            path: &str,
            names: &[String],
            arrays: &ArrayList,
            meta_keys: &[String],
            meta_values: &[String],
        ) -> Result<()>;

        // Compiled shim functions.
        fn call_kernel(kernel: Kernel, inputs: &ArrayList) -> Result<UniquePtr<ArrayList>>;
        fn group_expert_select(
            gates: &Array,
            bias: &Array,
            top_k: i32,
            n_group: i32,
            topk_group: i32,
            routed_scaling_factor: f32,
            norm_topk_prob: bool,
        ) -> Result<UniquePtr<ArrayList>>;
    }
}
