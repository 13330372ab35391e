//! Feeds arbitrary bytes to the GGUF reader. Beyond "no panic, no hang, no huge
//! allocation", it checks two properties:
//! - a prefix parse agrees with the whole-file parse, or asks for more bytes than it had;
//! - whatever parses survives a round trip through `GgufWriter` unchanged.
#![no_main]

use cairn_engine::gguf::{BytesGguf, GgufError, GgufFile, GgufWriter};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let full = GgufFile::parse(data);

    if let Some(&last) = data.last() {
        let cut = usize::from(last) * data.len() / 256;
        let len = data.len() as u64;
        match (GgufFile::parse_prefix(&data[..cut], Some(len)), &full) {
            (Err(GgufError::NeedMoreBytes { needed_at_least }), _) => {
                assert!(needed_at_least > cut as u64 && needed_at_least <= len);
            }
            // Fewer bytes of a wrong magic: reported with fewer bytes, or, when the whole
            // file is shorter than a magic but its first bytes match, as truncated.
            (
                Err(GgufError::BadMagic { .. } | GgufError::Truncated { offset: 0, .. }),
                Err(GgufError::BadMagic { .. }),
            ) => {}
            (prefix, full) => assert_eq!(format!("{prefix:?}"), format!("{full:?}")),
        }
        let _ = GgufFile::parse_prefix(&data[..cut], None);
    }

    let Ok(file) = full else { return };
    let _ = file.architecture();
    let _ = file.tokenizer_spec();
    let md = &file.metadata;
    for (key, _) in md.iter() {
        let _ = (
            md.get_u32(key),
            md.get_u64(key),
            md.get_f32(key),
            md.get_str(key),
        );
        let _ = (
            md.get_bool(key),
            md.get_str_array(key),
            md.get_i32_array(key),
        );
    }

    let g = BytesGguf::new(data.to_vec()).expect("parsed once, parses again");
    let mut w = GgufWriter::new();
    for (key, value) in md.iter() {
        w.add(key, value.clone());
    }
    for t in &file.tensors {
        let bytes = g
            .tensor_data(&t.name)
            .expect("a listed tensor is in bounds");
        assert_eq!(bytes.len() as u64, t.n_bytes);
        w.add_tensor(t.name.clone(), &t.dims, t.ty, bytes);
    }
    let again = BytesGguf::new(w.finish()).expect("writer output parses");
    assert_eq!(format!("{:?}", again.file.metadata), format!("{md:?}"));
    assert_eq!(again.file.alignment, file.alignment);
    assert_eq!(again.file.tensors.len(), file.tensors.len());
    for (a, b) in again.file.tensors.iter().zip(&file.tensors) {
        assert_eq!(
            (&a.name, &a.dims, a.ty, a.n_bytes),
            (&b.name, &b.dims, b.ty, b.n_bytes)
        );
        assert_eq!(again.tensor_data(&a.name).ok(), g.tensor_data(&b.name).ok());
    }
});
