"""Operations on a whole checkpoint directory: retention (gc) and verification."""
