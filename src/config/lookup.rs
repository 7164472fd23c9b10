//! The per-request settings a `[[tenants]]` or `[[models]]` entry may set
//! (mode, summarizer, agent_tool), and whether a conversation is held out
//! of compaction: the tenant's entry, then the model's,
//! then the `[compaction]` table's.

use super::schema::{Config, Mode, ModelConfig, Summarizer, TenantConfig};

impl Config {
    /// The model the summarizer calls for a conversation with `model`:
    /// `compaction.summarizer_model`, else the conversation's own.
    pub fn summarizer_model_for<'a>(&'a self, model: &'a str) -> &'a str {
        match self.compaction.summarizer_model.as_str() {
            "" => model,
            m => m,
        }
    }

    /// Whether `conversation` is among the `compaction.holdout_ratio`
    /// held out of compaction: a fixed function of its id, so every
    /// replica, and a restarted one, holds out the same conversations.
    pub fn held_out(&self, conversation: &str) -> bool {
        let ratio = self.compaction.holdout_ratio;
        if ratio <= 0.0 {
            return false;
        }
        let hash = blake3::hash(conversation.as_bytes());
        let draw = u64::from_le_bytes(hash.as_bytes()[..8].try_into().unwrap_or_default());
        // The draw in [0, 1).
        ((draw >> 11) as f64 / (1u64 << 53) as f64) < ratio
    }

    /// The mode of `tenant`'s requests to `model`: the tenant's entry,
    /// then the model's, then `compaction.mode`.
    pub fn mode_for(&self, tenant: &str, model: &str) -> Mode {
        self.layered(tenant, model, |t| t.mode, |m| m.mode)
            .unwrap_or(self.compaction.mode)
    }

    /// A per-request setting: the first `[[tenants]]` entry whose id starts
    /// `tenant` that sets it, else `model`'s `[[models]]` entry's.
    fn layered<T>(
        &self,
        tenant: &str,
        model: &str,
        of_tenant: impl Fn(&TenantConfig) -> Option<T>,
        of_model: impl Fn(&ModelConfig) -> Option<T>,
    ) -> Option<T> {
        self.tenants
            .iter()
            .find(|t| tenant.starts_with(&t.id.to_ascii_lowercase()))
            .and_then(of_tenant)
            .or_else(|| self.model_entry(model).and_then(of_model))
    }

    /// The summarizer of `tenant`'s requests to `model`: the tenant's
    /// entry, then the model's, then `compaction.summarizer` (the same
    /// order as [`Config::mode_for`]).
    pub fn summarizer_for(&self, tenant: &str, model: &str) -> Summarizer {
        self.layered(tenant, model, |t| t.summarizer, |m| m.summarizer)
            .unwrap_or(self.compaction.summarizer)
    }

    /// Whether `tenant`'s requests to `model` are offered `compactor_compact`:
    /// the tenant's entry, then the model's, then `compaction.agent_tool`.
    pub fn agent_tool_for(&self, tenant: &str, model: &str) -> bool {
        self.layered(tenant, model, |t| t.agent_tool, |m| m.agent_tool)
            .unwrap_or(self.compaction.agent_tool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holdout_is_a_share_fixed_by_the_ids() {
        let ids: Vec<String> = (0..4000).map(|i| format!("conv_{i:024x}")).collect();
        let held = |ratio: &str| {
            let c = Config::from_toml(&format!("[compaction]\nholdout_ratio = {ratio}\n")).unwrap();
            ids.iter()
                .filter(|id| c.held_out(id))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert!(held("0").is_empty());
        assert_eq!(held("1").len(), ids.len());
        let tenth = held("0.1");
        assert!((320..480).contains(&tenth.len()), "{}", tenth.len());
        // The same ids every time, and a larger share holds them too.
        assert_eq!(tenth, held("0.1"));
        let quarter = held("0.25");
        assert!(tenth.iter().all(|id| quarter.contains(id)));
        assert!(Config::from_toml("[compaction]\nholdout_ratio = 1.5\n").is_err());
    }

    #[test]
    fn summarizer_is_set_per_tenant_then_model_then_globally() {
        let c = Config::from_toml(
            "[compaction]\nsummarizer = \"auto\"\n\
             [[models]]\nmatch = \"remote*\"\ncontext_window = 1000\nsummarizer = \"provider\"\n\
             [[tenants]]\nid = \"0123456789AB\"\nsummarizer = \"local\"\n",
        )
        .unwrap();
        assert_eq!(c.summarizer_for("fff", "gpt-4o"), Summarizer::Auto);
        assert_eq!(c.summarizer_for("fff", "remote-1"), Summarizer::Provider);
        assert_eq!(
            c.summarizer_for("0123456789abcdef", "remote-1"),
            Summarizer::Local
        );
        assert_eq!(
            Config::default().summarizer_for("fff", "m"),
            Summarizer::Local,
            "the default"
        );
        assert!(Config::from_toml("[compaction]\nsummarizer = \"sometimes\"\n").is_err());
        assert!(Config::from_toml("[compaction]\nprovider_timeout_secs = 0\n").is_err());
    }

    #[test]
    fn modes_go_tenant_then_model_then_default() {
        let c = Config::from_toml(
            "[compaction]\nmode = \"off\"\n\
             [[models]]\nmatch = \"watched*\"\ncontext_window = 1000\nmode = \"observe\"\n\
             [[tenants]]\nid = \"0123456789AB\"\nmode = \"auto\"\n",
        )
        .unwrap();
        assert_eq!(c.mode_for("fff", "gpt-4o"), Mode::Off);
        assert_eq!(c.mode_for("fff", "watched-1"), Mode::Observe);
        assert_eq!(c.mode_for("0123456789abcdef", "watched-1"), Mode::Auto);
        assert_eq!(Mode::parse(" Observe "), Some(Mode::Observe));
        assert_eq!(Mode::parse("sometimes"), None);
        assert!(Config::from_toml("[[tenants]]\nid = \"0123\"\n").is_err());
        assert!(Config::from_toml("[compaction]\nmode = \"maybe\"\n").is_err());
    }
}
