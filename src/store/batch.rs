//! What the backends share in writing a batch: the conversations of its
//! exchanges, each once, and the rule by which a conversation's row takes
//! a batch's (written once, the same on both backends).

use super::records::{ClientIds, ExchangeRecord, Record};

/// A conversation's part of a batch, its exchanges taken by the rule its
/// row takes batches by ([`conversation_merge`]), so that a batch writes
/// what its exchanges written one by one, in any order, would.
pub(super) struct ConversationSpan<'a> {
    pub(super) tenant: &'a str,
    /// The key of its first exchange in the batch, claimed as a write of
    /// that exchange alone would.
    pub(super) explicit_key: Option<&'a str>,
    /// The earliest exchange's start.
    pub(super) created_ms: i64,
    /// The newest exchange's start.
    pub(super) last_seen_ms: i64,
    /// The newest exchange's model.
    pub(super) model: &'a str,
    /// The earliest preview given.
    pub(super) preview: Option<&'a str>,
    /// The newest client and ids given.
    pub(super) client: Option<&'a str>,
    pub(super) ids: ClientIds,
}

impl<'a> ConversationSpan<'a> {
    fn of(e: &'a ExchangeRecord) -> Self {
        ConversationSpan {
            tenant: &e.tenant,
            explicit_key: e.explicit_key.as_deref(),
            created_ms: e.started_ms,
            last_seen_ms: e.started_ms,
            model: &e.model,
            preview: e.preview.as_deref(),
            client: e.client.as_deref(),
            ids: e.client_ids.clone(),
        }
    }

    /// Takes `e`, a later exchange of the batch.
    fn take(&mut self, e: &'a ExchangeRecord) {
        let preview = e.preview.as_deref();
        if e.started_ms < self.created_ms {
            self.created_ms = e.started_ms;
            self.preview = preview.or(self.preview);
        } else {
            self.preview = self.preview.or(preview);
        }
        let newest = e.started_ms >= self.last_seen_ms;
        if newest {
            self.last_seen_ms = e.started_ms;
            self.model = &e.model;
        }
        let client = e.client.as_deref();
        self.client = match newest {
            true => client.or(self.client),
            false => self.client.or(client),
        };
        let ids = &e.client_ids;
        for (mine, theirs) in [
            (&mut self.ids.header, &ids.header),
            (&mut self.ids.session, &ids.session),
            (&mut self.ids.cache_key, &ids.cache_key),
        ] {
            if theirs.is_some() && (newest || mine.is_none()) {
                mine.clone_from(theirs);
            }
        }
    }
}

/// The conversations of a batch's exchanges, each once, in the order they
/// first appear (every backend writes them before the exchanges).
pub(super) fn conversation_spans(batch: &[Record]) -> Vec<(&str, ConversationSpan<'_>)> {
    let mut order: Vec<&str> = Vec::new();
    let mut spans: foldhash::HashMap<&str, ConversationSpan<'_>> = Default::default();
    for rec in batch {
        if let Record::Exchange(e) = rec {
            match spans.entry(&e.conversation) {
                std::collections::hash_map::Entry::Occupied(mut span) => span.get_mut().take(e),
                std::collections::hash_map::Entry::Vacant(v) => {
                    order.push(&e.conversation);
                    v.insert(ConversationSpan::of(e));
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
