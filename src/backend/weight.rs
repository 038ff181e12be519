//! `Weight`: a linear layer's weight as the forward sees it.

use super::Tensor;

/// A linear layer's weight [n × k] as the forward sees it: the host values, and a copy already on the device
/// when the caller made one (`Backend::upload_weight`), so a device backend does not copy it per call.
#[derive(Clone, Copy)]
pub struct Weight<'a> {
    pub host: &'a [f32],
    pub resident: Option<&'a Tensor>,
}

impl<'a> Weight<'a> {
    pub fn host(w: &'a [f32]) -> Self {
        Weight {
            host: w,
            resident: None,
        }
    }
}

/// A packed linear held in a device backend's own memory (`Backend::upload_packed`), for a forward that reads
/// it many times (eval): only the backend that made it can read it.
pub struct PackedResident(pub(crate) Box<dyn std::any::Any + Send + Sync>);
