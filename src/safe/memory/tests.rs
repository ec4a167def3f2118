//! Unit tests of the range and size checks.

use super::*;

#[test]
fn ranges_are_checked() {
    assert_eq!(bounds("t", &(2..5), 8).unwrap(), (2, 5));
    assert_eq!(bounds("t", &(..), 8).unwrap(), (0, 8));
    assert_eq!(bounds("t", &(3..=3), 8).unwrap(), (3, 4));
    assert_eq!(bounds("t", &(4..9), 8).unwrap_err(), CudaError::OutOfBounds { what: "t", start: 4, end: 9, len: 8 });
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 5..2;
    assert!(bounds("t", &reversed, 8).is_err());
}

#[test]
fn byte_sizes_do_not_overflow_silently() {
    assert_eq!(byte_size::<u32>("t", 10).unwrap(), 40);
    assert!(matches!(byte_size::<u64>("t", usize::MAX / 2), Err(CudaError::SizeOverflow { elem_size: 8, .. })));
}
