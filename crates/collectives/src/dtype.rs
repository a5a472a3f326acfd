//! Element types and reduction operators, and the reduction kernels the schedules' `Reduce`
//! steps run on raw bytes.
//!
//! Buffers travel as bytes (the wire does not care about types); the kernels reinterpret them
//! as the element type with `bytemuck` when the bytes are aligned (user slices and the
//! driver's staging buffers always are) and fall back to element-by-element decoding when not.
//! Integer reductions wrap on overflow (as MPI and NCCL do for sums of integers).

use half::{bf16, f16};

/// The element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary64.
    F64,
    /// IEEE 754 binary16 (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned byte.
    U8,
}

impl DType {
    /// Every element type, for tests and tables.
    pub const ALL: [DType; 7] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// The short name used in errors and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Parses [`DType::name`].
    pub fn parse(text: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == text)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A reduction operator. All are commutative and, on integers, associative; on floating
/// point the result can depend on the order of operations, which the algorithms fix (every
/// rank gets bit-identical results from one call).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum (for floats, a NaN operand is kept from the left side, as `f32::min` does not).
    Min,
    /// Maximum.
    Max,
    /// Sum divided by the number of ranks (integers: truncating division).
    Avg,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] =
        [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// The short name used in errors and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

/// A Rust type that is one of the [`DType`]s. Sealed: the set is fixed.
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed + 'static {
    /// The matching element type.
    const DTYPE: DType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
        }
    };
}
element!(f32, DType::F32);
element!(f64, DType::F64);
element!(f16, DType::F16);
element!(bf16, DType::BF16);
element!(i32, DType::I32);
element!(i64, DType::I64);
element!(u8, DType::U8);

/// Arithmetic the kernels need, per element type.
trait Arith: bytemuck::Pod {
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    fn divide(self, n: usize) -> Self;
}

macro_rules! float_arith {
    ($t:ty, $c:ty, $to:expr, $from:expr) => {
        impl Arith for $t {
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                let (x, y) = ($to(a), $to(b));
                $from(match op {
                    ReduceOp::Sum | ReduceOp::Avg => x + y,
                    ReduceOp::Prod => x * y,
                    ReduceOp::Min => {
                        if y < x {
                            y
                        } else {
                            x
                        }
                    }
                    ReduceOp::Max => {
                        if y > x {
                            y
                        } else {
                            x
                        }
                    }
                })
            }
            fn divide(self, n: usize) -> Self {
                $from($to(self) / n as $c)
            }
        }
    };
}
float_arith!(f32, f32, |v: f32| v, |v: f32| v);
float_arith!(f64, f64, |v: f64| v, |v: f64| v);
float_arith!(f16, f32, |v: f16| v.to_f32(), f16::from_f32);
float_arith!(bf16, f32, |v: bf16| v.to_f32(), bf16::from_f32);

macro_rules! int_arith {
    ($t:ty) => {
        impl Arith for $t {
            #[inline(always)]
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn divide(self, n: usize) -> Self {
                self / (n as $t)
            }
        }
    };
}
int_arith!(i32);
int_arith!(i64);
int_arith!(u8);

fn reduce_typed<T: Arith>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    match (bytemuck::try_cast_slice_mut::<u8, T>(dst), bytemuck::try_cast_slice::<u8, T>(src)) {
        (Ok(d), Ok(s)) => match op {
            // One loop per operator so the compiler vectorizes each.
            ReduceOp::Sum | ReduceOp::Avg => {
                d.iter_mut().zip(s).for_each(|(a, b)| *a = T::combine(ReduceOp::Sum, *a, *b))
            }
            ReduceOp::Prod => d.iter_mut().zip(s).for_each(|(a, b)| *a = T::combine(ReduceOp::Prod, *a, *b)),
            ReduceOp::Min => d.iter_mut().zip(s).for_each(|(a, b)| *a = T::combine(ReduceOp::Min, *a, *b)),
            ReduceOp::Max => d.iter_mut().zip(s).for_each(|(a, b)| *a = T::combine(ReduceOp::Max, *a, *b)),
        },
        _ => {
            let size = std::mem::size_of::<T>();
            for (d, s) in dst.chunks_exact_mut(size).zip(src.chunks_exact(size)) {
                let a: T = bytemuck::pod_read_unaligned(d);
                let b: T = bytemuck::pod_read_unaligned(s);
                d.copy_from_slice(bytemuck::bytes_of(&T::combine(op, a, b)));
            }
        }
    }
}

#[inline(always)]
fn zip3<T: Copy>(d: &mut [T], l: &[T], r: &[T], f: impl Fn(T, T) -> T) {
    d.iter_mut().zip(l.iter().zip(r)).for_each(|(d, (a, b))| *d = f(*a, *b));
}

fn combine_typed<T: Arith>(op: ReduceOp, dst: &mut [u8], left: &[u8], right: &[u8]) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(left),
        bytemuck::try_cast_slice::<u8, T>(right),
    ) {
        (Ok(d), Ok(l), Ok(r)) => {
            // One loop per operator so the compiler vectorizes each.
            match op {
                ReduceOp::Sum | ReduceOp::Avg => zip3(d, l, r, |a, b| T::combine(ReduceOp::Sum, a, b)),
                ReduceOp::Prod => zip3(d, l, r, |a, b| T::combine(ReduceOp::Prod, a, b)),
                ReduceOp::Min => zip3(d, l, r, |a, b| T::combine(ReduceOp::Min, a, b)),
                ReduceOp::Max => zip3(d, l, r, |a, b| T::combine(ReduceOp::Max, a, b)),
            }
        }
        _ => {
            let size = std::mem::size_of::<T>();
            for ((d, a), b) in
                dst.chunks_exact_mut(size).zip(left.chunks_exact(size)).zip(right.chunks_exact(size))
            {
                let a: T = bytemuck::pod_read_unaligned(a);
                let b: T = bytemuck::pod_read_unaligned(b);
                d.copy_from_slice(bytemuck::bytes_of(&T::combine(op, a, b)));
            }
        }
    }
}

fn divide_typed<T: Arith>(buf: &mut [u8], n: usize) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(v) => v.iter_mut().for_each(|a| *a = a.divide(n)),
        Err(_) => {
            for d in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
                let a: T = bytemuck::pod_read_unaligned(d);
                d.copy_from_slice(bytemuck::bytes_of(&a.divide(n)));
            }
        }
    }
}

/// `dst[i] = dst[i] op src[i]` for every element; `Avg` sums (the division comes once, at the
/// end, from [`divide`]). Lengths must be equal multiples of the element size.
pub fn reduce(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    debug_assert_eq!(dst.len() % dtype.size(), 0);
    match dtype {
        DType::F32 => reduce_typed::<f32>(op, dst, src),
        DType::F64 => reduce_typed::<f64>(op, dst, src),
        DType::F16 => reduce_typed::<f16>(op, dst, src),
        DType::BF16 => reduce_typed::<bf16>(op, dst, src),
        DType::I32 => reduce_typed::<i32>(op, dst, src),
        DType::I64 => reduce_typed::<i64>(op, dst, src),
        DType::U8 => reduce_typed::<u8>(op, dst, src),
    }
}

/// `dst[i] = left[i] op right[i]` for every element: [`reduce`] with the left operand read
/// from another buffer (the same result as copying `left` into `dst` and reducing `right` into
/// it, without the copy). Lengths must be equal multiples of the element size.
pub fn combine(dtype: DType, op: ReduceOp, dst: &mut [u8], left: &[u8], right: &[u8]) {
    debug_assert_eq!(dst.len(), left.len());
    debug_assert_eq!(dst.len(), right.len());
    debug_assert_eq!(dst.len() % dtype.size(), 0);
    match dtype {
        DType::F32 => combine_typed::<f32>(op, dst, left, right),
        DType::F64 => combine_typed::<f64>(op, dst, left, right),
        DType::F16 => combine_typed::<f16>(op, dst, left, right),
        DType::BF16 => combine_typed::<bf16>(op, dst, left, right),
        DType::I32 => combine_typed::<i32>(op, dst, left, right),
        DType::I64 => combine_typed::<i64>(op, dst, left, right),
        DType::U8 => combine_typed::<u8>(op, dst, left, right),
    }
}

/// Divides every element by `n` (the last step of `Avg`).
pub fn divide(dtype: DType, buf: &mut [u8], n: usize) {
    match dtype {
        DType::F32 => divide_typed::<f32>(buf, n),
        DType::F64 => divide_typed::<f64>(buf, n),
        DType::F16 => divide_typed::<f16>(buf, n),
        DType::BF16 => divide_typed::<bf16>(buf, n),
        DType::I32 => divide_typed::<i32>(buf, n),
        DType::I64 => divide_typed::<i64>(buf, n),
        DType::U8 => divide_typed::<u8>(buf, n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `a`'s bytes one byte into a buffer (misaligned for i32).
    fn unaligned(a: &[i32]) -> [u8; 17] {
        let mut out = [0u8; 17];
        out[1..].copy_from_slice(bytemuck::cast_slice(a));
        out
    }

    #[test]
    fn kernels_match_scalar_arithmetic_aligned_and_not() {
        let a: Vec<i32> = vec![1, -5, 7, i32::MAX];
        let b: Vec<i32> = vec![2, 3, -9, 1];
        let mut d = bytemuck::cast_slice::<i32, u8>(&a).to_vec();
        reduce(DType::I32, ReduceOp::Sum, &mut d, bytemuck::cast_slice(&b));
        assert_eq!(bytemuck::pod_collect_to_vec::<u8, i32>(&d), vec![3, -2, -2, i32::MIN]);
        // Misaligned: one byte in.
        let mut shifted = [0u8; 17];
        shifted[1..].copy_from_slice(bytemuck::cast_slice(&a));
        let mut src = [0u8; 17];
        src[1..].copy_from_slice(bytemuck::cast_slice(&b));
        reduce(DType::I32, ReduceOp::Max, &mut shifted[1..], &src[1..]);
        assert_eq!(bytemuck::pod_collect_to_vec::<u8, i32>(&shifted[1..]), vec![2, 3, 7, i32::MAX]);
        let mut h = bytemuck::cast_slice::<f16, u8>(&[f16::from_f32(3.0)]).to_vec();
        reduce(DType::F16, ReduceOp::Prod, &mut h, bytemuck::cast_slice(&[f16::from_f32(-2.0)]));
        divide(DType::F16, &mut h, 4);
        assert_eq!(bytemuck::pod_read_unaligned::<f16>(&h).to_f32(), -1.5);
        // combine = copy + reduce, aligned and not, every operator.
        for op in ReduceOp::ALL {
            let mut want = bytemuck::cast_slice::<i32, u8>(&a).to_vec();
            reduce(DType::I32, op, &mut want, bytemuck::cast_slice(&b));
            let mut got = vec![0u8; want.len()];
            combine(DType::I32, op, &mut got, bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
            assert_eq!(got, want);
            let mut got = [0u8; 17];
            combine(DType::I32, op, &mut got[1..], &unaligned(&a)[1..], &unaligned(&b)[1..]);
            assert_eq!(&got[1..], &want[..]);
        }
    }
}
