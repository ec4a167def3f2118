//! Module images, read before the driver sees them: what an image is (PTX text, an ELF cubin or a
//! fatbin), checked whole (every size a cubin's or fatbin's headers state lies within it, since
//! the driver reads an image without a length), and which kernels it names (PTX `.entry`
//! directives, a cubin's `.text.` sections). Pure functions of the bytes: no driver call.

/// What a module image is.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum ImageKind {
    Ptx,
    /// An ELF cubin and the kernels it defines (its `.text.<kernel>` sections).
    Cubin {
        entries: Vec<String>,
    },
    Fatbin,
}

const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// What `image` is, checked whole: every size a cubin's or fatbin's headers state lies within
/// it (the driver reads an image without a length). The reason, when it is no image.
pub(super) fn image_kind(image: &[u8]) -> std::result::Result<ImageKind, String> {
    let u16_at = |at: usize| image.get(at..at + 2).map(|b| u16::from_le_bytes(b.try_into().expect("two bytes")));
    let u32_at = |at: usize| image.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().expect("four bytes")));
    let u64_at = |at: usize| image.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().expect("eight bytes")));
    let short = |what: &str| format!("a truncated {what} of {} bytes", image.len());
    if image.starts_with(b"\x7fELF") {
        if image.get(4) != Some(&2) || image.get(5) != Some(&1) {
            return Err("an ELF image that is not 64-bit little-endian (a cubin is)".into());
        }
        let (Some(shoff), Some(shentsize), Some(shnum), Some(shstrndx)) =
            (u64_at(0x28), u16_at(0x3A), u16_at(0x3C), u16_at(0x3E))
        else {
            return Err(short("ELF header"));
        };
        let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
            return Err(short("ELF header"));
        };
        let within = |offset: u64, size: u64| offset.checked_add(size).is_some_and(|end| end <= image.len() as u64);
        if shentsize < 64 || !within(shoff, u64::from(shentsize) * u64::from(shnum)) {
            return Err(format!("section headers past the end of a cubin of {} bytes", image.len()));
        }
        if phnum > 0 && (phentsize < 56 || !within(phoff, u64::from(phentsize) * u64::from(phnum))) {
            return Err(format!("program headers past the end of a cubin of {} bytes", image.len()));
        }
        let section = |i: u16| shoff as usize + usize::from(i) * usize::from(shentsize);
        let mut sections = Vec::with_capacity(usize::from(shnum));
        for i in 0..shnum {
            let at = section(i);
            let (Some(name), Some(kind), Some(offset), Some(size)) =
                (u32_at(at), u32_at(at + 4), u64_at(at + 0x18), u64_at(at + 0x20))
            else {
                return Err(short("cubin"));
            };
            // SHT_NOBITS (8) occupies no bytes of the file.
            if kind != 8 && !within(offset, size) {
                return Err(format!(
                    "section {i} ({size} bytes at {offset}) past the end of a cubin of {} bytes",
                    image.len()
                ));
            }
            sections.push((name, kind, offset, size));
        }
        let names = sections
            .get(usize::from(shstrndx))
            .map(|&(_, _, offset, size)| &image[offset as usize..(offset + size) as usize]);
        let entries = names
            .map(|names| {
                sections
                    .iter()
                    .filter_map(|&(name, _, _, _)| {
                        let rest = names.get(name as usize..)?;
                        let end = rest.iter().position(|&b| b == 0)?;
                        std::str::from_utf8(&rest[..end]).ok()?.strip_prefix(".text.").map(str::to_string)
                    })
                    .collect()
            })
            .unwrap_or_default();
        return Ok(ImageKind::Cubin { entries });
    }
    if u32_at(0) == Some(FATBIN_MAGIC) {
        let (Some(header), Some(size)) = (u16_at(6), u64_at(8)) else { return Err(short("fatbin header")) };
        if u64::from(header).checked_add(size).is_none_or(|end| end > image.len() as u64) {
            return Err(format!(
                "a fatbin that states {header} + {size} bytes in an image of {} bytes (truncated?)",
                image.len()
            ));
        }
        return Ok(ImageKind::Fatbin);
    }
    if image.starts_with(b"//")
        || image.windows(7).any(|w| w == b".entry ")
        || image.windows(8).any(|w| w == b".version")
    {
        return Ok(ImageKind::Ptx);
    }
    Err(format!("{} bytes that are no PTX text, cubin (ELF) or fatbin", image.len()))
}

/// The names of the `.entry` directives of PTX text (`.visible .entry name(`).
pub(super) fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|line| line.split(".entry ").nth(1))
        .map(|rest| rest.split(|c: char| c == '(' || c.is_whitespace()).next().unwrap_or("").to_string())
        .filter(|name| !name.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ptx_entries_are_found_with_and_without_parameters() {
        let ptx =
            ".visible .entry ppnrt_trap()\n{\n}\n.visible .entry ppnrt_fill_u32(\n.param .u64 a\n)\n.func helper(\n";
        assert_eq!(super::ptx_entries(ptx), vec!["ppnrt_trap", "ppnrt_fill_u32"]);
        assert!(super::ptx_entries("// no kernels here\n.func f(\n").is_empty());
        assert_eq!(
            super::ptx_entries(crate::kernels::HELPERS_PTX),
            ["ppnrt_copy_bytes", "ppnrt_gated_copy_bytes", "ppnrt_gated_signal"]
        );
    }

    #[test]
    fn module_images_are_checked_whole_before_the_driver_reads_them() {
        use super::{ImageKind, image_kind};
        let fatbin: &[u8] = include_bytes!("../../../tests/data/test_params.fatbin");
        let cubin: &[u8] = include_bytes!("../../../tests/data/test_params.cubin");
        assert_eq!(image_kind(fatbin), Ok(ImageKind::Fatbin));
        assert_eq!(image_kind(cubin), Ok(ImageKind::Cubin { entries: vec!["ppnrt_test_params12".into()] }));
        assert_eq!(image_kind(crate::kernels::HELPERS_PTX.as_bytes()), Ok(ImageKind::Ptx));
        // Every truncation of either is refused (never handed to the driver).
        for image in [fatbin, cubin] {
            for len in [0, 3, 16, 63, 64, image.len() / 2, image.len() - 1] {
                let refused = image_kind(&image[..len]);
                assert!(refused.is_err(), "{len} of {} bytes: {refused:?}", image.len());
            }
        }
        assert!(image_kind(&[0u8; 64]).unwrap_err().contains("no PTX text, cubin (ELF) or fatbin"));
        let mut huge = fatbin.to_vec();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(image_kind(&huge).unwrap_err().contains("truncated"), "a size that overflows");
        let mut far = cubin.to_vec();
        far[0x28..0x30].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(image_kind(&far).unwrap_err().contains("section headers past the end"));
    }
}
