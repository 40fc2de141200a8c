//! The IQ and MXFP4 formats' lookup tables as CUDA source, written from the CPU kernels' own
//! tables (`kernels::formats::iq_grids`, `kernels::blocks::KVALUES_MXFP4`) and put in front
//! of `matmul.cu` when NVRTC compiles it, so the two sides cannot disagree. Grids become
//! `__device__` arrays (lanes look up different entries, which constant memory would
//! serialize); the 16-entry level tables become four packed words each, for `lookup16`'s
//! byte permutes.

use std::fmt::Write;

use kernels::blocks::KVALUES_MXFP4;
use kernels::formats::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS,
    KVALUES_IQ4NL,
};

fn array<T: std::fmt::LowerHex>(out: &mut String, decl: &str, name: &str, values: &[T]) {
    let _ = write!(out, "__device__ const {decl} {name}[{}] = {{", values.len());
    for (i, v) in values.iter().enumerate() {
        if i % 8 == 0 {
            out.push_str("\n   ");
        }
        let _ = write!(out, " {v:#x},");
    }
    out.push_str("\n};\n");
}

fn packed_levels(out: &mut String, name: &str, levels: &[i8; 16]) {
    for (w, four) in levels.chunks_exact(4).enumerate() {
        let word = u32::from_le_bytes([four[0] as u8, four[1] as u8, four[2] as u8, four[3] as u8]);
        let _ = writeln!(out, "#define {name}_W{w} {word:#010x}u");
    }
}

/// The tables' CUDA declarations (the source `matmul.cu` is compiled after).
pub fn cuda_source() -> String {
    let mut s = String::from("// Lookup tables, written by crates/gpu/src/lookup_tables.rs.\n");
    packed_levels(&mut s, "KVALUES_IQ4NL", &KVALUES_IQ4NL);
    packed_levels(&mut s, "KVALUES_MXFP4", &KVALUES_MXFP4);
    array(&mut s, "unsigned char", "KSIGNS_IQ2XS", &KSIGNS_IQ2XS);
    array(&mut s, "unsigned long long", "IQ2XXS_GRID", &IQ2XXS_GRID);
    array(&mut s, "unsigned long long", "IQ2XS_GRID", &IQ2XS_GRID);
    array(&mut s, "unsigned long long", "IQ2S_GRID", &IQ2S_GRID);
    array(&mut s, "unsigned long long", "IQ1S_GRID", &IQ1S_GRID);
    array(&mut s, "unsigned int", "IQ3XXS_GRID", &IQ3XXS_GRID);
    array(&mut s, "unsigned int", "IQ3S_GRID", &IQ3S_GRID);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_declared_whole_and_levels_packed_little_endian() {
        let s = cuda_source();
        assert!(s.contains("__device__ const unsigned long long IQ1S_GRID[2048] = {"));
        assert!(s.contains("__device__ const unsigned int IQ3S_GRID[512] = {"));
        // IQ4_NL's first four levels -127, -104, -83, -65 are bytes 0x81, 0x98, 0xad, 0xbf.
        assert!(
            s.contains("#define KVALUES_IQ4NL_W0 0xbfad9881u"),
            "{}",
            &s[..400]
        );
        // MXFP4's last four levels -4, -6, -8, -12.
        assert!(s.contains("#define KVALUES_MXFP4_W3 0xf4f8fafcu"));
        let entries = s.matches("0x").count();
        let expected = 128 + 256 + 512 + 1024 + 2048 + 256 + 512 + 8;
        assert_eq!(entries, expected);
    }
}
