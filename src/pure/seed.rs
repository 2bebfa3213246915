//! `Seed` and its named random streams: the one source of randomness, ChaCha8 from the `rand` ecosystem.
//!
//! The generator is `chacha20::ChaCha8Rng` (the ChaCha8 stream cipher as an RNG: a 256-bit key, a 64-bit stream
//! number and a 64-bit block counter), and the draws on it (`shuffle`, `random_range`, ...) are `rand`'s. A unit
//! test pins the first outputs of a stream and a shuffle, so a dependency update that changed them (and with them
//! every scenario's allocated pages and golden layouts) fails here first.
//!
//! **Named streams.** `seed.stream(name)` is the generator keyed by the seed alone, on the stream numbered by the
//! name alone:
//!
//! - key = the seed's 8 little-endian bytes after a fixed 24-byte tag (`KEY_TAG`), so distinct seeds give distinct
//!   keys (the map is injective by construction; `SeedableRng::seed_from_u64` is not used because its PCG32
//!   expansion of the `u64` is not shown to be injective);
//! - stream number = the first 8 bytes (little-endian) of SHA-256 of `STREAM_TAG` followed by the name.
//!
//! Two streams `(a, x)` and `(b, y)` are the same key stream only if their keys are equal, i.e. `a == b`, and their
//! stream numbers are equal. So streams of different seeds never alias (unlike mixing the name's hash into the seed,
//! `seed ^ hash(name)`, where seed `a` with name `x` equals seed `a ^ hash(x) ^ hash(y)` with name `y`), and two
//! names of one seed alias only if their stream numbers collide, which does not depend on the seed: a unit test
//! checks every name in use (and `faults.qp.<n>` for thousands of queue pairs) for distinct numbers.
//!
//! Each stream is its own generator, so adding a consumer (a new name) never shifts another stream's draws, and a
//! stream can be opened at any time in any order. Deriving one costs one SHA-256 block and a ChaCha key set-up;
//! [`StreamId`] holds a derived number for callers that open the same stream under many seeds.

use chacha20::ChaCha8Rng;
use rand::SeedableRng as _;
use sha2::{Digest as _, Sha256};

/// The generator of every named stream (ChaCha with 8 rounds).
pub type SimRng = ChaCha8Rng;

/// The single seed of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seed(pub u64);

/// The fixed first 24 bytes of every key; the seed fills the last 8.
const KEY_TAG: &[u8; 24] = b"kvrelay.seed.v1.chacha8:";

/// Prefixed to a name before hashing it into a stream number.
const STREAM_TAG: &[u8] = b"kvrelay.stream.v1:";

/// The ChaCha stream number of a name (derive once, open under any seed with [`Seed::stream_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The stream number of `name`: the first 8 bytes of SHA-256(`STREAM_TAG` ‖ name), little-endian.
    pub fn named(name: &str) -> StreamId {
        let digest = Sha256::new().chain_update(STREAM_TAG).chain_update(name.as_bytes()).finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        StreamId(u64::from_le_bytes(first))
    }

    /// The stream number of `<prefix>.<index>`, e.g. `StreamId::indexed("faults.qp", 3)` for `faults.qp.3`.
    pub fn indexed(prefix: &str, index: u64) -> StreamId {
        StreamId::named(&format!("{prefix}.{index}"))
    }
}

impl Seed {
    /// The 256-bit ChaCha key of this seed: `KEY_TAG` then the seed, little-endian (injective in the seed).
    pub fn key(self) -> [u8; 32] {
        let mut key = [0u8; 32];
        key[..24].copy_from_slice(KEY_TAG);
        key[24..].copy_from_slice(&self.0.to_le_bytes());
        key
    }

    /// The stream named `name` of this seed (e.g. `pages.decode`, `faults.qp.3`), at its first draw.
    pub fn stream(self, name: &str) -> SimRng {
        self.stream_of(StreamId::named(name))
    }

    /// The stream numbered `id` of this seed, at its first draw.
    pub fn stream_of(self, id: StreamId) -> SimRng {
        let mut rng = SimRng::from_seed(self.key());
        rng.set_stream(id.0);
        rng
    }
}

#[cfg(test)]
mod tests {
    use rand::seq::SliceRandom as _;
    use rand::{Rng as _, RngExt as _};

    use super::*;

    /// Pins the generator and `rand`'s draws on it: a change here changes every scenario's allocated pages and
    /// golden file (review them, then update these numbers). The words were checked against an independent ChaCha8
    /// block function (RFC 8439's quarter round, 8 rounds, 64-bit counter and 64-bit nonce = the stream number):
    /// block 0 of key `Seed(7).key()` and nonce `StreamId::named("pages.prefill")`, words taken low word first.
    #[test]
    fn stream_outputs_are_pinned() {
        let mut rng = Seed(7).stream("pages.prefill");
        let words: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(words, PINNED_WORDS);
        let mut rng = Seed(7).stream("pages.prefill");
        let below: Vec<u64> = (0..3).map(|_| rng.random_range(0..1000)).collect();
        assert_eq!(below, PINNED_BELOW);
        let mut pages: Vec<u32> = (1..11).collect();
        pages.shuffle(&mut Seed(1).stream("pages.decode"));
        assert_eq!(pages, PINNED_SHUFFLE);
    }

    const PINNED_WORDS: [u64; 3] = [251_926_456_946_999_988, 5_654_902_448_799_750_773, 11_077_762_653_780_938_774];
    const PINNED_BELOW: [u64; 3] = [13, 306, 600];
    const PINNED_SHUFFLE: [u32; 10] = [3, 8, 4, 1, 9, 10, 6, 5, 7, 2];

    #[test]
    fn stream_numbers_are_pinned() {
        assert_eq!(StreamId::named("pages.prefill"), StreamId(12_195_278_529_103_848_007));
        assert_eq!(StreamId::indexed("faults.qp", 3), StreamId::named("faults.qp.3"));
    }

    /// Distinct seeds give distinct keys; the key carries the seed verbatim.
    #[test]
    fn keys_are_injective_in_the_seed() {
        for seed in [0, 1, 2, u64::MAX, 1 << 63] {
            assert_eq!(&Seed(seed).key()[24..], &seed.to_le_bytes());
            assert_eq!(&Seed(seed).key()[..24], KEY_TAG);
        }
        assert_ne!(Seed(1).key(), Seed(2).key());
    }

    /// The old derivation (`seed ^ fnv(name)`) made seed `a`/name `x` equal seed `a ^ fnv(x) ^ fnv(y)`/name `y`.
    /// Here the seed is the key and the name the stream number, so such a pair stays apart.
    #[test]
    fn streams_do_not_alias_across_seeds() {
        let fnv = |name: &str| {
            name.bytes()
                .fold(0xCBF2_9CE4_8422_2325u64, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01B3))
        };
        let (a, x, y) = (7u64, "pages.prefill", "pages.decode");
        let b = a ^ fnv(x) ^ fnv(y);
        assert_eq!(a ^ fnv(x), b ^ fnv(y), "the old scheme aliases this pair");
        let mut first = Seed(a).stream(x);
        let mut second = Seed(b).stream(y);
        let first: Vec<u64> = (0..4).map(|_| first.next_u64()).collect();
        let second: Vec<u64> = (0..4).map(|_| second.next_u64()).collect();
        assert_ne!(first, second);
        let (first, second) = (Seed(a).stream(x), Seed(b).stream(y));
        assert!(first.get_seed() != second.get_seed() || first.get_stream() != second.get_stream());
    }

    /// Every name the allocators use, and the fault streams of many queue pairs, have distinct stream numbers (a
    /// collision would make two of them draw the same numbers under every seed).
    #[test]
    fn stream_names_in_use_have_distinct_numbers() {
        let mut names = Vec::new();
        for side in ["prefill", "decode"] {
            for stream in ["pages", "slots", "aux"] {
                names.push(format!("{stream}.{side}"));
            }
            names.extend((0..64).map(|component| format!("state{component}.{side}")));
        }
        names.extend((0..65_536).map(|qp| format!("faults.qp.{qp}")));
        let mut ids: Vec<u64> = names.iter().map(|name| StreamId::named(name).0).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), names.len());
    }

    /// Opening streams in any order, or opening a new one, does not change another's draws.
    #[test]
    fn adding_a_stream_does_not_shift_another() {
        let draw = |rng: &mut SimRng| -> Vec<u64> { (0..8).map(|_| rng.next_u64()).collect() };
        let alone = draw(&mut Seed(5).stream("pages.decode"));
        let mut other = Seed(5).stream("faults.qp.0");
        let _ = draw(&mut other);
        assert_eq!(draw(&mut Seed(5).stream("pages.decode")), alone);
        assert_ne!(draw(&mut Seed(5).stream("pages.prefill")), alone);
        assert_ne!(draw(&mut Seed(6).stream("pages.decode")), alone);
        let id = StreamId::named("pages.decode");
        assert_eq!(draw(&mut Seed(5).stream_of(id)), alone);
    }
}
