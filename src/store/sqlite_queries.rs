//! The SQLite backend's [`super::Queries`]: each a read-only connection of
//! its own, never the writer thread's (WAL lets them read while the proxy
//! writes); deletions on a maintenance connection beside the writer.

use super::query::{
    export, list_conversations, open_read_only, resolve_id, show, ConversationDetail,
    ConversationExport, ConversationSummary, QueryError,
};
use super::retention::{self, Removed, Victim};
use crate::config::Config;

impl super::Queries for super::sqlite::SqliteReads {
    fn conversations(
        &self,
        config: &Config,
        limit: usize,
    ) -> Result<Vec<ConversationSummary>, QueryError> {
        list_conversations(&open_read_only(self.path())?, config, limit)
    }

    fn conversation_detail(
        &self,
        config: &Config,
        id: &str,
    ) -> Result<ConversationDetail, QueryError> {
        show(&open_read_only(self.path())?, config, id)
    }

    fn conversation_export(
        &self,
        config: &Config,
        id: &str,
    ) -> Result<ConversationExport, QueryError> {
        export(&open_read_only(self.path())?, config, id)
    }

    fn resolve_conversation(&self, id: &str) -> Result<String, QueryError> {
        resolve_id(&open_read_only(self.path())?, id)
    }

    fn savings(&self, config: &Config) -> Result<super::savings::Report, QueryError> {
        Ok(super::savings::report(
            &open_read_only(self.path())?,
            config,
            None,
        )?)
    }

    fn victim(&self, name: &str) -> Result<Victim, QueryError> {
        retention::victim(&open_read_only(self.path())?, name)
    }

    fn victims_seen_before(&self, cutoff_ms: i64, limit: usize) -> Result<Vec<Victim>, QueryError> {
        let conn = open_read_only(self.path())?;
        let found = retention::seen_before(&conn, cutoff_ms, limit)?;
        Ok(retention::victims_of(&conn, found)?)
    }

    fn delete_conversations(&self, ids: &[String]) -> Result<Removed, QueryError> {
        let conn = retention::open_for_maintenance(self.path())?;
        Ok(retention::delete_and_prune(&conn, ids)?)
    }
}
