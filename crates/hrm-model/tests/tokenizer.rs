//! Training a byte-level BPE with the `tokenizers` crate's trainer.

use hrm_model::tokenizer::{END_OF_TEXT, train_byte_level_bpe};

#[test]
fn trains_a_byte_level_bpe_that_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("text.txt");
    let text = "It was a dark and stormy night; the rain fell in torrents.\n\
                In the beginning God created the heaven and the earth.\n";
    std::fs::write(&path, text.repeat(50)).unwrap();
    let tokenizer = train_byte_level_bpe(&[path], 300).unwrap();
    assert_eq!(
        tokenizer.token_to_id(END_OF_TEXT),
        Some(0),
        "end-of-text is token 0"
    );
    let vocab = tokenizer.get_vocab_size(true);
    assert!(vocab > 257 && vocab <= 300, "vocabulary of {vocab}");
    // Merges were learnt: the training text takes far fewer tokens than bytes. Any text, even
    // characters never seen, round-trips through the byte alphabet.
    let ids = tokenizer.encode(text, false).unwrap().get_ids().len();
    assert!(
        ids * 2 < text.len(),
        "{ids} tokens for {} bytes",
        text.len()
    );
    for sample in ["It was a dark and stormy night", "naïve café — 日本語 ✓"] {
        let ids = tokenizer.encode(sample, false).unwrap().get_ids().to_vec();
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), sample);
    }
}
