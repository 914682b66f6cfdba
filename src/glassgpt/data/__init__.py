"""Text corpora, prepared token-id directories, and the batches training draws from them.

- `corpus`: where text comes from (Tiny Shakespeare inside the package, the user's files and glob
  patterns), read in blocks.
- `pipeline`: `prepare`, a corpus -> a data directory, streamed in bounded memory, optionally
  across worker processes, with the same ids as encoding the whole text at once.
- `datadir`: the directory's files, committed as a whole and read back memory-mapped.
- `batches`: random training windows and sequential evaluation windows.
"""

from glassgpt.data.batches import BatchSampler, sequential_batches
from glassgpt.data.corpus import (
    TINYSHAKESPEARE_ENV,
    TINYSHAKESPEARE_SHA256,
    Corpus,
    cache_dir,
    find_text_files,
    packaged_tinyshakespeare,
    tinyshakespeare,
    tinyshakespeare_path,
)
from glassgpt.data.datadir import (
    SPLITS,
    PreparedData,
    id_dtype,
    is_prepared_from,
    sha256_of,
)
from glassgpt.data.pipeline import (
    DEFAULT_BUFFER_BYTES,
    default_data_dir,
    prepare,
    prepared_tinyshakespeare,
)
from glassgpt.storage.layout import DATA_FILES, META_FILE, TOKENIZER_FILE

__all__ = [
    "DATA_FILES",
    "DEFAULT_BUFFER_BYTES",
    "META_FILE",
    "SPLITS",
    "TINYSHAKESPEARE_ENV",
    "TINYSHAKESPEARE_SHA256",
    "TOKENIZER_FILE",
    "BatchSampler",
    "Corpus",
    "PreparedData",
    "cache_dir",
    "default_data_dir",
    "find_text_files",
    "id_dtype",
    "is_prepared_from",
    "packaged_tinyshakespeare",
    "prepare",
    "prepared_tinyshakespeare",
    "sequential_batches",
    "sha256_of",
    "tinyshakespeare",
    "tinyshakespeare_path",
]
