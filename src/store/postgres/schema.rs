//! The PostgreSQL schema: its migrations, each applied once under an
//! advisory lock, and the version a database is at.

use deadpool_postgres::Pool;

use crate::store::error::StoreError;

/// The schema's versions, oldest first: each is applied once, in its own
/// transaction, and recorded in `schema_migrations`. A change to the schema
/// is a new entry, never an edit of an old one.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        r#"
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value BYTEA NOT NULL
);
-- Each distinct item (message, tool output, request parameters…) once,
-- whichever replica saw it first.
CREATE TABLE items (
    hash BYTEA PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE conversations (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    explicit_key TEXT,
    created_ms   BIGINT NOT NULL,
    last_seen_ms BIGINT NOT NULL,
    model        TEXT NOT NULL DEFAULT '',
    -- Its first user message (redacted, bounded), the client of its latest
    -- exchange, and the latest ids the client sent for it.
    preview             TEXT,
    client              TEXT,
    conversation_header TEXT,
    session_id          TEXT,
    prompt_cache_key    TEXT
);
CREATE UNIQUE INDEX conversations_key
    ON conversations (tenant, explicit_key) WHERE explicit_key IS NOT NULL;
CREATE INDEX conversations_seen ON conversations (last_seen_ms);
-- Exchange ids are handed out in blocks (see ID_BLOCK).
CREATE SEQUENCE exchange_id_blocks;
CREATE TABLE exchanges (
    id              BIGINT PRIMARY KEY,
    conversation_id TEXT NOT NULL REFERENCES conversations(id),
    tenant          TEXT NOT NULL,
    endpoint        TEXT NOT NULL,
    model           TEXT NOT NULL,
    prefix_exchange BIGINT,
    prefix_len      BIGINT NOT NULL DEFAULT 0,
    prefix_full     BOOLEAN NOT NULL DEFAULT FALSE,
    suffix_items    BYTEA NOT NULL,
    request_len     BIGINT NOT NULL,
    params          BYTEA NOT NULL,
    response_items  BYTEA NOT NULL,
    response_id     TEXT,
    input_tokens    BIGINT,
    output_tokens   BIGINT,
    cached_tokens   BIGINT,
    status          INTEGER NOT NULL,
    streamed        BOOLEAN NOT NULL,
    partial         BOOLEAN NOT NULL,
    error           TEXT,
    started_ms      BIGINT NOT NULL,
    latency_ms      DOUBLE PRECISION NOT NULL,
    ttfb_ms         DOUBLE PRECISION,
    chain_request   BYTEA,
    chain_full      BYTEA,
    compaction_id   TEXT,
    -- The window the request was measured against, and its source; the
    -- client and the ids it sent.
    context_window      BIGINT,
    window_source       TEXT,
    client              TEXT,
    conversation_header TEXT,
    session_id          TEXT,
    prompt_cache_key    TEXT
);
CREATE INDEX exchanges_conversation ON exchanges (conversation_id, id);
-- Whether an exchange is its conversation's tip (nothing continued it).
CREATE INDEX exchanges_prefix ON exchanges (prefix_exchange)
    WHERE prefix_exchange IS NOT NULL;
-- What a replica that has not seen a conversation looks it up by.
CREATE INDEX exchanges_chain_request ON exchanges (tenant, chain_request)
    WHERE chain_request IS NOT NULL;
CREATE INDEX exchanges_chain_full ON exchanges (tenant, chain_full)
    WHERE chain_full IS NOT NULL;
CREATE INDEX exchanges_response ON exchanges (tenant, response_id)
    WHERE response_id IS NOT NULL;
CREATE TABLE compactions (
    id              TEXT PRIMARY KEY,
    tenant          TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    covered_len     BIGINT NOT NULL,
    covered_chain   BYTEA NOT NULL,
    replacement     TEXT NOT NULL,
    rung            TEXT NOT NULL,
    reason          TEXT NOT NULL,
    tokens_before   BIGINT NOT NULL,
    tokens_after    BIGINT NOT NULL,
    items_removed   BIGINT NOT NULL,
    items_kept      BIGINT NOT NULL,
    summary         TEXT,
    facts           TEXT,
    base_id         TEXT,
    summary_calls   BIGINT NOT NULL,
    duration_ms     BIGINT NOT NULL,
    created_ms      BIGINT NOT NULL,
    summary_tokens  BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX compactions_conversation ON compactions (tenant, conversation_id, created_ms);
CREATE INDEX compactions_chain ON compactions (tenant, covered_chain);
CREATE TABLE windows (
    upstream   TEXT NOT NULL,
    model      TEXT NOT NULL,
    "window"   BIGINT NOT NULL,
    source     TEXT NOT NULL,
    updated_ms BIGINT NOT NULL,
    PRIMARY KEY (upstream, model)
);
-- Who computes a conversation's compaction now, until when: a replica
-- that dies mid-compaction leaves a claim that expires.
CREATE TABLE compaction_claims (
    tenant          TEXT NOT NULL,
    conversation_id TEXT NOT NULL,
    owner           TEXT NOT NULL,
    expires_ms      BIGINT NOT NULL,
    PRIMARY KEY (tenant, conversation_id)
);
"#,
    ),
    (
        2,
        r#"
-- Observe mode's would-be compactions are recorded but never applied;
-- what each compaction and exchange saved, for the savings accounting.
ALTER TABLE compactions
    ADD COLUMN observed              BOOLEAN NOT NULL DEFAULT false,
    ADD COLUMN summary_output_tokens BIGINT  NOT NULL DEFAULT 0,
    ADD COLUMN tokens_saved          BIGINT  NOT NULL DEFAULT 0;
ALTER TABLE exchanges
    ADD COLUMN mode                   TEXT   NOT NULL DEFAULT 'auto',
    ADD COLUMN tokens_saved           BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN tokens_saved_potential BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN observed_compaction    TEXT,
    ADD COLUMN recall_rounds          BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN recall_input_tokens    BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN recall_output_tokens   BIGINT NOT NULL DEFAULT 0;
"#,
    ),
    (
        3,
        r#"
-- Manual compactions asked for and not yet applied, whichever replica was
-- asked: the replica that serves the conversation's next request deletes
-- the row, and only one can (see listen.rs).
CREATE TABLE manual_compactions (
    conversation_id TEXT PRIMARY KEY REFERENCES conversations(id) ON DELETE CASCADE,
    tenant          TEXT NOT NULL,
    requested_ms    BIGINT NOT NULL
);
"#,
    ),
    (
        4,
        r#"
-- A conversation's timeline in the order it happened: replicas hand out
-- exchange ids in blocks, so ids interleave across them.
CREATE INDEX exchanges_timeline ON exchanges (conversation_id, started_ms, id);
"#,
    ),
    (
        5,
        r#"
-- The latest compaction attempt of a conversation that stored nothing
-- (discarded, failed), whichever replica made it: `compact` asks any.
CREATE TABLE compaction_attempts (
    conversation_id TEXT PRIMARY KEY REFERENCES conversations(id) ON DELETE CASCADE,
    tenant          TEXT NOT NULL,
    at_ms           BIGINT NOT NULL,
    result          TEXT NOT NULL,
    tokens_before   BIGINT,
    tokens_after    BIGINT,
    error           TEXT
);
"#,
    ),
    (
        6,
        r#"
-- Each compaction's facts checklist and the items it removed, as JSON
-- (NULL for one stored before audits were kept).
ALTER TABLE compactions ADD COLUMN audit TEXT;
"#,
    ),
    (
        7,
        r#"
-- Every compaction stored is announced, with what finding it needs
-- (see Postgres::announced): a replica that hears them all need not ask
-- for a conversation's newest.
CREATE FUNCTION compactor_announce_compaction() RETURNS trigger AS $$
BEGIN
    IF NOT NEW.observed THEN
        PERFORM pg_notify('compactor_compacted', concat_ws(' ', NEW.tenant, NEW.id,
            NEW.covered_len, encode(NEW.covered_chain, 'hex'), NEW.created_ms,
            NEW.conversation_id));
    END IF;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;
CREATE TRIGGER compactions_announced AFTER INSERT ON compactions
    FOR EACH ROW EXECUTE PROCEDURE compactor_announce_compaction();
"#,
    ),
    (
        8,
        r#"
-- Every query of a conversation's exchanges is served by exchanges_timeline,
-- whose columns begin with this one's: it only cost every insert.
DROP INDEX IF EXISTS exchanges_conversation;
"#,
    ),
    (
        9,
        r#"
-- The conversation an exchange's request left, the one of the longest
-- prefix it repeats (a branch): a replica goes on in a conversation
-- without looking a longer prefix up only while none left it.
ALTER TABLE exchanges ADD COLUMN branched_from TEXT;
CREATE INDEX exchanges_branched ON exchanges (tenant, branched_from)
    WHERE branched_from IS NOT NULL;
"#,
    ),
    (
        10,
        r#"
-- Prompt tokens the upstream reported written to its cache, and of those
-- the ones written for an hour (NULL: not reported), for the bill.
ALTER TABLE exchanges
    ADD COLUMN cache_write_tokens    BIGINT,
    ADD COLUMN cache_write_1h_tokens BIGINT;
"#,
    ),
    (
        11,
        r#"
-- What a compaction's summary calls' prompts read from and wrote to the
-- upstream's cache, as reported (0: not reported, or no call), so the bill
-- prices them as they were billed.
ALTER TABLE compactions
    ADD COLUMN summary_cached_tokens         BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN summary_cache_write_tokens    BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN summary_cache_write_1h_tokens BIGINT NOT NULL DEFAULT 0;
"#,
    ),
];

/// The key of the advisory lock migrations run under, so that replicas
/// starting together apply each migration once.
const MIGRATION_LOCK: i64 = 0x636f_6d70_6163_7401;

pub(super) fn latest_version() -> i32 {
    MIGRATIONS.last().map_or(0, |(v, _)| *v)
}

pub(super) async fn applied_version(client: &tokio_postgres::Client) -> Result<i32, StoreError> {
    let exists: bool = client
        .query_one("SELECT to_regclass('schema_migrations') IS NOT NULL", &[])
        .await?
        .get(0);
    if !exists {
        return Ok(0);
    }
    let row = client
        .query_one(
            "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

/// Applies the migrations the database lacks, under an advisory lock: a
/// replica starting meanwhile waits, then finds them applied.
pub(super) async fn migrate(pool: &Pool) -> Result<(), StoreError> {
    let mut client = pool.get().await?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    let result = apply_migrations(&mut client).await;
    // Unlocked whatever happened: the lock is the session's, and the
    // session goes back to the pool.
    let unlocked = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await;
    result?;
    unlocked?;
    Ok(())
}

async fn apply_migrations(client: &mut deadpool_postgres::Object) -> Result<(), StoreError> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (
                 version    INTEGER PRIMARY KEY,
                 applied_ms BIGINT NOT NULL
             )",
        )
        .await?;
    let applied = applied_version(client).await?;
    if applied > latest_version() {
        tracing::warn!(
            applied,
            known = latest_version(),
            "the database's schema is newer than this build's"
        );
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > applied) {
        let tx = client.transaction().await?;
        tx.batch_execute(sql).await?;
        tx.execute(
            "INSERT INTO schema_migrations (version, applied_ms) VALUES ($1, $2)",
            &[version, &crate::ids::now_ms()],
        )
        .await?;
        tx.commit().await?;
        tracing::info!(version, "database schema migrated");
    }
    Ok(())
}
