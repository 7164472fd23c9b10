//! What the backends share in writing a batch: the conversations of its
//! exchanges, each once, and the rule by which a conversation's row takes
//! a batch's (written once, the same on both backends).

use super::records::{ClientIds, ExchangeRecord, Record};

/// A conversation's part of a batch: it is created as of its first
/// exchange, last seen (with its model, client and ids) as of its last; its
/// preview is the first one given.
pub(super) struct ConversationSpan<'a> {
    pub(super) first: &'a ExchangeRecord,
    pub(super) last: &'a ExchangeRecord,
    pub(super) preview: Option<&'a str>,
    pub(super) client: Option<&'a str>,
    pub(super) ids: ClientIds,
}

/// The conversations of a batch's exchanges, each once, in the order they
/// first appear (every backend writes them before the exchanges).
pub(super) fn conversation_spans(batch: &[Record]) -> Vec<(&str, ConversationSpan<'_>)> {
    let mut order: Vec<&str> = Vec::new();
    let mut spans: foldhash::HashMap<&str, ConversationSpan<'_>> = Default::default();
    for rec in batch {
        if let Record::Exchange(e) = rec {
            let span = spans.entry(&e.conversation).or_insert_with(|| {
                order.push(&e.conversation);
                ConversationSpan {
                    first: e,
                    last: e,
                    preview: None,
                    client: None,
                    ids: ClientIds::default(),
                }
            });
            span.last = e;
            span.preview = span.preview.or(e.preview.as_deref());
            span.client = e.client.as_deref().or(span.client);
            let ids = &e.client_ids;
            for (mine, theirs) in [
                (&mut span.ids.header, &ids.header),
                (&mut span.ids.session, &ids.session),
                (&mut span.ids.cache_key, &ids.cache_key),
            ] {
                if theirs.is_some() {
                    mine.clone_from(theirs);
                }
            }
        }
    }
    order
        .into_iter()
        .filter_map(|c| spans.remove(c).map(|span| (c, span)))
        .collect()
}

/// How a conversation's row takes a batch's when the row is there already,
/// the same on both backends (`excluded` is the batch's row). Batches need
/// not commit in the order of their exchanges: another replica's batch, or
/// a journaled one imported late, may carry older exchanges than the row
/// holds. So whichever commits first, the row ends the same: what the
/// exchanges say together, as one batch of them all would have written it.
/// Created as of the earliest exchange, with its preview; last seen as of
/// the newest, with the model, client and ids it gave; what the side that
/// is not the newest (or the earliest, for the preview) gave only fills in
/// what the other lacks. At equal times the batch committing last gives the
/// model, client and ids, the first the preview.
pub(super) fn conversation_merge() -> &'static str {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let newest = "excluded.last_seen_ms >= conversations.last_seen_ms";
        let earliest = "excluded.created_ms < conversations.created_ms";
        // `column` from the side `batch_wins` picks, filled in from the other.
        let either = |column: &str, batch_wins: &str| {
            format!(
                "{column} = CASE WHEN {batch_wins}
                     THEN COALESCE(excluded.{column}, conversations.{column})
                     ELSE COALESCE(conversations.{column}, excluded.{column}) END"
            )
        };
        let mut set = vec![
            either("created_ms", earliest),
            either("last_seen_ms", newest),
            either("preview", earliest),
        ];
        set.extend(
            [
                "model",
                "client",
                "conversation_header",
                "session_id",
                "prompt_cache_key",
            ]
            .map(|column| either(column, newest)),
        );
        format!("ON CONFLICT (id) DO UPDATE SET {}", set.join(",\n    "))
    });
    &SQL
}
