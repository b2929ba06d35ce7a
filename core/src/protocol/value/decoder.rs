//! The deserializer that carries a [`DecodeContext`] through a value: a wrapper around the
//! format's deserializer (and the visitors, seeds and accessors serde passes between them) that
//! hands every nested value the same context, and that alone knows what to do with a remote
//! reference (the newtype struct named [`RREF_TOKEN`]).

use std::fmt::{self, Display};

use crate::protocol::RRefForkData;
use serde::de::{self, DeserializeSeed, Deserializer, Visitor};

use super::{DecodeContext, Failure, RREF_TOKEN};

/// The format's deserializer `D`, with the decode's context.
pub(super) struct Decoder<'c, 'a, D> {
    inner: D,
    ctx: &'c DecodeContext<'a>,
}

impl<'c, 'a, D> Decoder<'c, 'a, D> {
    pub(super) fn new(inner: D, ctx: &'c DecodeContext<'a>) -> Self {
        Self { inner, ctx }
    }
}

/// A visitor, seed or accessor of serde's, with the context.
struct With<'c, 'a, T> {
    inner: T,
    ctx: &'c DecodeContext<'a>,
}

impl<'c, 'a, T> With<'c, 'a, T> {
    fn new(inner: T, ctx: &'c DecodeContext<'a>) -> Self {
        Self { inner, ctx }
    }
}

/// Forwards `deserialize_*` methods to the format's deserializer, with the visitor wrapped.
macro_rules! forward {
    ($($method:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, Failure> {
            let ctx = self.ctx;
            self.inner
                .$method($($arg,)* With::new(visitor, ctx))
                .map_err(|e| ctx.errors.lift(e))
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Decoder<'_, '_, D> {
    type Error = Failure;

    forward!(
        deserialize_any(),
        deserialize_bool(),
        deserialize_i8(),
        deserialize_i16(),
        deserialize_i32(),
        deserialize_i64(),
        deserialize_i128(),
        deserialize_u8(),
        deserialize_u16(),
        deserialize_u32(),
        deserialize_u64(),
        deserialize_u128(),
        deserialize_f32(),
        deserialize_f64(),
        deserialize_char(),
        deserialize_str(),
        deserialize_string(),
        deserialize_bytes(),
        deserialize_byte_buf(),
        deserialize_option(),
        deserialize_unit(),
        deserialize_unit_struct(name: &'static str),
        deserialize_seq(),
        deserialize_tuple(len: usize),
        deserialize_tuple_struct(name: &'static str, len: usize),
        deserialize_map(),
        deserialize_struct(name: &'static str, fields: &'static [&'static str]),
        deserialize_enum(name: &'static str, variants: &'static [&'static str]),
        deserialize_identifier(),
        deserialize_ignored_any(),
    );

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Failure> {
        let ctx = self.ctx;
        if name == RREF_TOKEN {
            // A remote reference: the fork that travels is accepted here, and the handle goes
            // to the reference's visitor.
            let data = de::Deserialize::deserialize(self.inner).map_err(|e| ctx.errors.lift(e))?;
            return ctx.accept::<V>(data, visitor);
        }
        self.inner
            .deserialize_newtype_struct(name, With::new(visitor, ctx))
            .map_err(|e| ctx.errors.lift(e))
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

impl DecodeContext<'_> {
    /// Accepts the fork `data`, if its message announced it, and gives the handle to the
    /// reference's `visitor`.
    fn accept<'de, V: Visitor<'de>>(
        &self,
        data: RRefForkData,
        visitor: V,
    ) -> Result<V::Value, Failure> {
        let met = {
            let mut announced = self.announced.borrow_mut();
            let at = announced.iter().position(|a| *a == data);
            at.map(|i| announced.swap_remove(i))
        };
        if met.is_none() {
            self.unannounced.set(Some(data));
            return Err(Failure(format!(
                "a reference its message did not announce ({}, fork {})",
                data.rref, data.fork
            )));
        }
        let handle = self.agent.accept(data);
        self.accepted.borrow_mut().push(handle);
        let ticket = self.agent.hand_over(handle);
        let out = visitor.visit_u64(ticket);
        // Only the reference's visitor redeems tickets; whatever was not redeemed is let go.
        self.agent.take_back(ticket);
        out
    }
}

/// Forwards `visit_*` methods of primitives to the visitor, with its error lowered into the
/// format's.
macro_rules! visit {
    ($($method:ident($ty:ty)),* $(,)?) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
            let ctx = self.ctx;
            self.inner.$method::<Failure>(v).map_err(|f| ctx.errors.lower_de(f))
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for With<'_, '_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    visit!(
        visit_bool(bool),
        visit_i8(i8),
        visit_i16(i16),
        visit_i32(i32),
        visit_i64(i64),
        visit_i128(i128),
        visit_u8(u8),
        visit_u16(u16),
        visit_u32(u32),
        visit_u64(u64),
        visit_u128(u128),
        visit_f32(f32),
        visit_f64(f64),
        visit_char(char),
        visit_str(&str),
        visit_borrowed_str(&'de str),
        visit_string(String),
        visit_bytes(&[u8]),
        visit_borrowed_bytes(&'de [u8]),
        visit_byte_buf(Vec<u8>),
    );

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        let ctx = self.ctx;
        self.inner
            .visit_none::<Failure>()
            .map_err(|f| ctx.errors.lower_de(f))
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        let ctx = self.ctx;
        self.inner
            .visit_unit::<Failure>()
            .map_err(|f| ctx.errors.lower_de(f))
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        let ctx = self.ctx;
        self.inner
            .visit_some(Decoder::new(d, ctx))
            .map_err(|f| ctx.errors.lower_de(f))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        let ctx = self.ctx;
        self.inner
            .visit_newtype_struct(Decoder::new(d, ctx))
            .map_err(|f| ctx.errors.lower_de(f))
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        let ctx = self.ctx;
        self.inner
            .visit_seq(With::new(seq, ctx))
            .map_err(|f| ctx.errors.lower_de(f))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        let ctx = self.ctx;
        self.inner
            .visit_map(With::new(map, ctx))
            .map_err(|f| ctx.errors.lower_de(f))
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        let ctx = self.ctx;
        self.inner
            .visit_enum(With::new(data, ctx))
            .map_err(|f| ctx.errors.lower_de(f))
    }
}

/// A seed: what it deserializes gets the context.
struct Seed<'c, 'a, S>(With<'c, 'a, S>);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<'_, '_, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        let ctx = self.0.ctx;
        self.0
            .inner
            .deserialize(Decoder::new(d, ctx))
            .map_err(|f| ctx.errors.lower_de(f))
    }
}

impl<'c, 'a, T> With<'c, 'a, T> {
    fn seed<S>(&self, seed: S) -> Seed<'c, 'a, S> {
        Seed(With::new(seed, self.ctx))
    }

    fn lift<E: Display>(&self, e: E) -> Failure {
        self.ctx.errors.lift(e)
    }
}

impl<'de, A: de::SeqAccess<'de>> de::SeqAccess<'de> for With<'_, '_, A> {
    type Error = Failure;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Failure> {
        let seed = self.seed(seed);
        let out = self.inner.next_element_seed(seed);
        out.map_err(|e| self.lift(e))
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'de, A: de::MapAccess<'de>> de::MapAccess<'de> for With<'_, '_, A> {
    type Error = Failure;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Failure> {
        let seed = self.seed(seed);
        let out = self.inner.next_key_seed(seed);
        out.map_err(|e| self.lift(e))
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, Failure> {
        let seed = self.seed(seed);
        let out = self.inner.next_value_seed(seed);
        out.map_err(|e| self.lift(e))
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'c, 'a, 'de, A: de::EnumAccess<'de>> de::EnumAccess<'de> for With<'c, 'a, A> {
    type Error = Failure;
    type Variant = With<'c, 'a, A::Variant>;

    fn variant_seed<T: DeserializeSeed<'de>>(
        self,
        seed: T,
    ) -> Result<(T::Value, Self::Variant), Failure> {
        let ctx = self.ctx;
        let seed = self.seed(seed);
        match self.inner.variant_seed(seed) {
            Ok((value, variant)) => Ok((value, With::new(variant, ctx))),
            Err(e) => Err(ctx.errors.lift(e)),
        }
    }
}

impl<'de, A: de::VariantAccess<'de>> de::VariantAccess<'de> for With<'_, '_, A> {
    type Error = Failure;

    fn unit_variant(self) -> Result<(), Failure> {
        let ctx = self.ctx;
        self.inner.unit_variant().map_err(|e| ctx.errors.lift(e))
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, Failure> {
        let ctx = self.ctx;
        let seed = self.seed(seed);
        self.inner
            .newtype_variant_seed(seed)
            .map_err(|e| ctx.errors.lift(e))
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, Failure> {
        let ctx = self.ctx;
        self.inner
            .tuple_variant(len, With::new(visitor, ctx))
            .map_err(|e| ctx.errors.lift(e))
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Failure> {
        let ctx = self.ctx;
        self.inner
            .struct_variant(fields, With::new(visitor, ctx))
            .map_err(|e| ctx.errors.lift(e))
    }
}
