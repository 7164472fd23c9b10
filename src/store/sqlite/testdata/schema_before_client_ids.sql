CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
-- Each distinct item (message, tool output, request parameters…) once.
-- A rowid table: bodies of kilobytes appended in arrival order, with the
-- hash in an index, insert about twice as fast as a WITHOUT ROWID table
-- ordered by random hashes.
CREATE TABLE IF NOT EXISTS items (
    hash BLOB PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS conversations (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    explicit_key TEXT,
    created_ms   INTEGER NOT NULL,
    last_seen_ms INTEGER NOT NULL,
    model        TEXT NOT NULL DEFAULT ''
);
CREATE UNIQUE INDEX IF NOT EXISTS conversations_key
    ON conversations (tenant, explicit_key) WHERE explicit_key IS NOT NULL;
-- Request items are stored as a reference to an earlier exchange's items
-- (prefix_exchange, prefix_len, prefix_full) plus the hashes that follow
-- (suffix_items: concatenated 32-byte hashes).
CREATE TABLE IF NOT EXISTS exchanges (
    id              INTEGER PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations(id),
    tenant          TEXT NOT NULL,
    endpoint        TEXT NOT NULL,
    model           TEXT NOT NULL,
    prefix_exchange INTEGER,
    prefix_len      INTEGER NOT NULL DEFAULT 0,
    prefix_full     INTEGER NOT NULL DEFAULT 0,
    suffix_items    BLOB NOT NULL,
    request_len     INTEGER NOT NULL,
    params          BLOB NOT NULL,
    response_items  BLOB NOT NULL,
    response_id     TEXT,
    input_tokens    INTEGER,
    output_tokens   INTEGER,
    cached_tokens   INTEGER,
    status          INTEGER NOT NULL,
    streamed        INTEGER NOT NULL,
    partial         INTEGER NOT NULL,
    error           TEXT,
    started_ms      INTEGER NOT NULL,
    latency_ms      REAL NOT NULL,
    ttfb_ms         REAL,
    chain_request   BLOB,
    chain_full      BLOB,
    compaction_id   TEXT
);
CREATE INDEX IF NOT EXISTS exchanges_conversation ON exchanges (conversation_id, id);
-- A compaction replaces the first covered_len items whose chain hash is
-- covered_chain with `replacement` (a JSON array, sent byte-identically).
CREATE TABLE IF NOT EXISTS compactions (
    id              TEXT PRIMARY KEY,
    tenant          TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    covered_len     INTEGER NOT NULL,
    covered_chain   BLOB NOT NULL,
    replacement     TEXT NOT NULL,
    rung            TEXT NOT NULL,
    reason          TEXT NOT NULL,
    tokens_before   INTEGER NOT NULL,
    tokens_after    INTEGER NOT NULL,
    items_removed   INTEGER NOT NULL,
    items_kept      INTEGER NOT NULL,
    summary         TEXT,
    facts           TEXT,
    base_id         TEXT,
    summary_calls   INTEGER NOT NULL,
    duration_ms     INTEGER NOT NULL,
    created_ms      INTEGER NOT NULL,
    summary_tokens  INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS compactions_conversation ON compactions (conversation_id, created_ms);
-- The context windows upstreams told (stated in an overflow answer, or
-- reported when asked), per upstream and model.
CREATE TABLE IF NOT EXISTS windows (
    upstream   TEXT NOT NULL,
    model      TEXT NOT NULL,
    window     INTEGER NOT NULL,
    source     TEXT NOT NULL,
    updated_ms INTEGER NOT NULL,
    PRIMARY KEY (upstream, model)
);
