//! Prints the shape of pallets in a runtime metadata file: calls, events, errors and storage with
//! their types spelled out. A maintenance tool for keeping the localnet's runtime in step with a
//! live chain (`cargo run -p iota-localnet --example dump_metadata -- FILE PALLET...`).

use frame_metadata::{RuntimeMetadata, RuntimeMetadataPrefixed, v16::StorageEntryType};
use parity_scale_codec::Decode;
use scale_info::{PortableRegistry, TypeDef, form::PortableForm};

fn describe(reg: &PortableRegistry, id: u32, depth: usize) -> String {
    let Some(ty) = reg.resolve(id) else {
        return format!("?{id}");
    };
    let path = ty.path.segments.last().cloned().unwrap_or_default();
    if depth > 3 {
        return format!("{path}#{id}");
    }
    match &ty.type_def {
        TypeDef::Primitive(p) => format!("{p:?}").to_lowercase(),
        TypeDef::Sequence(s) => format!("Vec<{}>", describe(reg, s.type_param.id, depth + 1)),
        TypeDef::Array(a) => format!("[{}; {}]", describe(reg, a.type_param.id, depth + 1), a.len),
        TypeDef::Compact(c) => format!("Compact<{}>", describe(reg, c.type_param.id, depth + 1)),
        TypeDef::Tuple(t) => format!(
            "({})",
            t.fields
                .iter()
                .map(|f| describe(reg, f.id, depth + 1))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        TypeDef::Composite(c) => format!("{path}{{{}}}", fields(reg, &c.fields, depth + 1)),
        TypeDef::Variant(v) => format!(
            "{path}[{}]",
            v.variants
                .iter()
                .map(|v| format!(
                    "{}={}{{{}}}",
                    v.index,
                    v.name,
                    fields(reg, &v.fields, depth + 1)
                ))
                .collect::<Vec<_>>()
                .join(" | ")
        ),
        TypeDef::BitSequence(_) => "BitSeq".into(),
    }
}

fn fields(reg: &PortableRegistry, f: &[scale_info::Field<PortableForm>], depth: usize) -> String {
    f.iter()
        .map(|f| match &f.name {
            Some(n) => format!("{n}: {}", describe(reg, f.ty.id, depth)),
            None => describe(reg, f.ty.id, depth),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (file, pallets) = args
        .split_first()
        .ok_or("usage: dump_metadata FILE PALLET...")?;
    let bytes = std::fs::read(file)?;
    let prefixed = RuntimeMetadataPrefixed::decode(&mut &bytes[..])?;
    let RuntimeMetadata::V16(md) = prefixed.1 else {
        return Err("only V16 metadata is supported".into());
    };
    let reg = &md.types;
    if pallets.iter().any(|p| p == "--extrinsic") {
        println!("versions {:?}", md.extrinsic.versions);
        println!("address {}", describe(reg, md.extrinsic.address_ty.id, 0));
        println!(
            "signature {}",
            describe(reg, md.extrinsic.signature_ty.id, 0)
        );
        for e in &md.extrinsic.transaction_extensions {
            println!(
                "ext {} ty={} implicit={}",
                e.identifier,
                describe(reg, e.ty.id, 0),
                describe(reg, e.implicit.id, 0)
            );
        }
        println!(
            "by_version {:?}",
            md.extrinsic.transaction_extensions_by_version
        );
        for api in &md.apis {
            println!(
                "api {} {:?}",
                api.name,
                api.methods.iter().map(|m| &m.name).collect::<Vec<_>>()
            );
        }
    }
    for p in md.pallets.iter().filter(|p| pallets.contains(&p.name)) {
        println!("## pallet {} index {}", p.name, p.index);
        for (kind, ty) in [
            ("call", p.calls.as_ref().map(|c| c.ty.id)),
            ("event", p.event.as_ref().map(|c| c.ty.id)),
            ("error", p.error.as_ref().map(|c| c.ty.id)),
        ] {
            let Some(id) = ty else { continue };
            let Some(TypeDef::Variant(v)) = reg.resolve(id).map(|t| &t.type_def) else {
                continue;
            };
            for var in &v.variants {
                println!(
                    "{kind} {} {}({})",
                    var.index,
                    var.name,
                    fields(reg, &var.fields, 0)
                );
            }
        }
        if let Some(s) = &p.storage {
            for e in &s.entries {
                let shape = match &e.ty {
                    StorageEntryType::Plain(v) => format!("value {}", describe(reg, v.id, 0)),
                    StorageEntryType::Map {
                        hashers,
                        key,
                        value,
                    } => format!(
                        "map {:?} key {} value {}",
                        hashers,
                        describe(reg, key.id, 0),
                        describe(reg, value.id, 0)
                    ),
                };
                println!(
                    "storage {} {:?} {shape} default 0x{}",
                    e.name,
                    e.modifier,
                    hex::encode(&e.default)
                );
            }
        }
        for c in &p.constants {
            println!(
                "const {} {} = 0x{}",
                c.name,
                describe(reg, c.ty.id, 0),
                hex::encode(&c.value)
            );
        }
    }
    Ok(())
}
