//! The label sets of the metrics that have labels, one struct each.

use prometheus_client::encoding::EncodeLabelSet;

/// Labels of `compactor_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RequestLabels {
    /// One of [`super::ENDPOINTS`].
    pub(super) endpoint: &'static str,
    /// Clamped to `STATUS_MIN..=STATUS_MAX`.
    pub(super) status: u16,
}

/// Labels of `compactor_compactions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct CompactionLabels {
    /// One of [`super::RUNGS`].
    pub(super) rung: &'static str,
    /// One of [`super::REASONS`].
    pub(super) reason: &'static str,
}

/// Labels of `compactor_compaction_triggers_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct TriggerLabels {
    /// One of [`super::TRIGGERS`].
    pub(super) trigger: &'static str,
}

/// Labels of `compactor_compaction_tokens_saved_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RungLabels {
    /// One of [`super::RUNGS`].
    pub(super) rung: &'static str,
}

/// Labels of `compactor_input_tokens_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct InputLabels {
    /// One of [`super::INPUT_KINDS`].
    pub(super) kind: &'static str,
}

/// Labels of `compactor_unfittable_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct GoalLabels {
    /// One of [`super::GOALS`].
    pub(super) goal: &'static str,
}

/// Labels of `compactor_provider_compaction_fallbacks_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct FallbackLabels {
    /// One of [`super::PROVIDER_FALLBACK_REASONS`].
    pub(super) reason: &'static str,
}

/// Labels of `compactor_compaction_facts_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct FactLabels {
    /// One of [`super::FACT_KINDS`].
    pub(super) kind: &'static str,
    /// One of [`super::FACT_STATES`].
    pub(super) state: &'static str,
}

/// Labels of `compactor_bill_dollars_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct BillLabels {
    /// One of [`super::BILL_KINDS`].
    pub(super) kind: &'static str,
}

/// Labels of `compactor_model_context_window`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct WindowLabels {
    /// The model's name as clients send it (escaped by the encoder).
    pub(super) model: String,
    /// Where the window came from: table, config, learned, discovered.
    pub(super) source: &'static str,
}
